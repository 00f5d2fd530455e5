"""One-call GPU benchmark and correctness run for the engine (issue: GPU engine). Run on the H200:

    python benchmarks/h200_engine.py --out $OUT [--sections correct,throughput,bs1,small,startup] [--hf-peer]

Builds random-weight models from hand-written configs (the Llama-3-8B shape and small shapes), runs vserve
and, where asked, HF transformers on the same prompts in the same process, and prints a short table last
(full JSON in OUT/h200_engine.json). Not part of the CPU test suite: it needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BW = 4.27e12  # measured device-to-device copy, bytes/s (../shared/GPU.md)
PEAK = 800e12  # measured bf16 matmul, FLOP/s

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                 bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
SMOLLM2 = dict(LLAMA3_8B, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2)
QWEN25_05B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
                  intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16")


def model_dir(cfg: dict) -> str:
    d = Path(tempfile.mkdtemp(prefix="vserve-shape-"))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def workload(n: int, seed: int, vocab: int, out_len: tuple[int, int], in_len=(100, 1024)):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(*in_len))] for _ in range(n)]
    outs = [rng.randint(*out_len) for _ in range(n)]
    return prompts, outs


class ScheduleRecorder:
    """Wraps the runner to record each step's shape, for the roofline bound of the run."""

    def __init__(self, runner) -> None:
        self.steps: list[tuple[int, int, int]] = []  # (tokens, decode rows, context tokens read by decodes)
        self.prefill_ctx: list[tuple[int, int]] = []  # (query tokens, context tokens) per prefill chunk
        self._orig = runner.launch
        runner.launch = self

    def __call__(self, sched, block_ids):
        dec = ctx = 0
        for req, n in zip(sched.requests, sched.num_scheduled_tokens):
            if n == 1:
                dec += 1
                ctx += req.num_computed_tokens + 1
            else:
                self.prefill_ctx.append((n, req.num_computed_tokens + n))
        self.steps.append((sched.total_tokens, dec, ctx))
        return self._orig(sched, block_ids)


def roofline_seconds(cfg: dict, rec: ScheduleRecorder) -> float:
    h, L, inter, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kvh = cfg["num_key_value_heads"]
    lin_params = L * (h * (h + 2 * kvh * hd) + h * h + 3 * h * inter)
    weight_bytes = 2 * (lin_params + V * h)
    kv_per_token = 2 * L * kvh * hd * 2
    t = 0.0
    for tokens, dec, ctx in rec.steps:
        flops = 2 * lin_params * tokens + 2 * V * h * dec
        t += max(weight_bytes / BW, flops / PEAK) + kv_per_token * ctx / BW
    for q, c in rec.prefill_ctx:  # attention FLOPs of prefill chunks (causal: about q * c)
        t += 4 * cfg["num_attention_heads"] * hd * q * c / PEAK
    return t


def run_vserve(cfg: dict, prompts, outs, **engine_args):
    from vserve import LLM, SamplingParams

    llm = LLM(model_dir(cfg), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", **engine_args)
    for _ in range(2):  # warm-up; the second pass hits the prefix cache as the timed run will, so the kernels of
        # that prefill's shape (a few recomputed tokens: the W4A16 tile kernel's launch for them) compile before timing
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    rec = ScheduleRecorder(llm.llm_engine.runner)
    torch.cuda.reset_peak_memory_stats()
    sps = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=o, ignore_eos=True) for o in outs]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = llm.generate(prompts, sps, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    assert n_out == sum(outs), (n_out, sum(outs))
    bound = roofline_seconds(cfg, rec)
    stats = llm.llm_engine.stats()
    result = dict(seconds=dt, output_tokens=n_out, output_tok_s=n_out / dt, bound_s=bound,
                  bound_tok_s=n_out / bound, frac_of_bound=bound / dt, steps=len(rec.steps),
                  preemptions=stats.num_preemptions, kv_blocks=stats.num_blocks,
                  memory_plan=llm.llm_engine.memory_plan.as_dict(),
                  torch_max_allocated=torch.cuda.max_memory_allocated(),
                  doctor_prediction=doctor_prediction(cfg, llm.llm_engine.config))
    del llm, rec
    free_gpu()
    return result


def free_gpu() -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def doctor_prediction(cfg: dict, ec) -> dict:
    """What `vserve doctor` predicts for these settings, before loading anything (no measured inputs)."""
    from vserve.core.memory import plan_memory
    from vserve.core.model_config import ModelConfig

    total = torch.cuda.get_device_properties(0).total_memory
    plan = plan_memory(ModelConfig.from_dict(cfg), gpu_memory_bytes=total,
                       gpu_memory_utilization=ec.gpu_memory_utilization, dtype_bytes=2, block_size=ec.block_size,
                       max_model_len=ec.max_model_len or cfg["max_position_embeddings"],
                       max_num_batched_tokens=ec.max_num_batched_tokens, max_num_seqs=ec.max_num_seqs,
                       cuda_graphs=not ec.enforce_eager)
    return dict(torch_peak_bytes=plan.torch_peak_bytes, num_blocks=plan.num_blocks, verdict=plan.verdict)


def hf_config(cfg: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                      if k not in ("architectures", "model_type", "torch_dtype")})


def hf_generate_batch(cfg: dict, prompts, out_len: int) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf_cfg = hf_config(cfg)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1)  # eos disabled
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o.generated_tokens) for o in out.values())
    del model
    free_gpu()
    return dict(seconds=dt, output_tokens=n, output_tok_s=n / dt)


def section_correct(results: dict, dtype: torch.dtype = torch.bfloat16, key: str = "correct_8b_vs_hf") -> None:
    """Greedy vserve vs HF transformers on the same random 8B-shape weights, 32 tokens (bf16 unless dtype)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from vserve import LLM, SamplingParams
    from vserve.core.loader import load_weights

    hf_cfg = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "model_type",
                                                                              "torch_dtype")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    llm = LLM(model_dir(LLAMA3_8B), load_format="dummy", skip_tokenizer_init=True,
              dtype=str(dtype).removeprefix("torch."), max_model_len=2048, enforce_eager=False)
    load_weights(llm.llm_engine.model, hf.named_parameters())
    prompts, _ = workload(4, 1, LLAMA3_8B["vocab_size"], (32, 32), in_len=(20, 200))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32,
                                                                                 ignore_eos=True), use_tqdm=False)]
    rows = []
    with torch.inference_mode():
        for p, g in zip(prompts, got):
            ids = torch.tensor([p], device="cuda")
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            div = next((i for i in range(32) if ref[i] != g[i]), None)
            gap = None
            if div is not None:  # the HF logit gap between the two candidates at the divergence
                logits = hf(torch.tensor([p + ref[:div]], device="cuda")).logits[0, -1].float()
                gap = float(logits[ref[div]] - logits[g[div]])
            rows.append(dict(prompt_len=len(p), equal=div is None, first_divergence=div, hf_logit_gap=gap))
    results[key] = rows
    del hf, llm
    free_gpu()


def section_correct32(results: dict) -> None:
    """The same check in float32 on the GPU (vserve's Triton kernels take fp32 with IEEE dots; torch keeps TF32
    off for matmuls by default): the rounding noise is ~1e-6 of a logit, so near-ties rarely flip a token."""
    section_correct(results, torch.float32, "correct_8b_vs_hf_fp32")


def section_throughput(results: dict, hf_peer: bool) -> None:
    V = LLAMA3_8B["vocab_size"]
    p, o = workload(256, 0, V, (100, 1024))
    results["8b_out_u100_1024"] = run_vserve(LLAMA3_8B, p, o, max_num_seqs=256, enforce_eager=False)
    o512 = [512] * len(p)
    results["8b_out_512"] = run_vserve(LLAMA3_8B, p, o512, max_num_seqs=256, enforce_eager=False)
    if hf_peer:
        results["8b_out_512_hf_generate_batch"] = hf_generate_batch(LLAMA3_8B, p, 512)


def section_throughput_u(results: dict) -> None:
    """Only the outputs-U[100,1024] workload (when device time is short)."""
    p, o = workload(256, 0, LLAMA3_8B["vocab_size"], (100, 1024))
    results["8b_out_u100_1024"] = run_vserve(LLAMA3_8B, p, o, max_num_seqs=256, enforce_eager=False)


def section_bs1(results: dict) -> None:
    p, _ = workload(1, 3, LLAMA3_8B["vocab_size"], (512, 512), in_len=(128, 128))
    results["8b_bs1_in128_out512"] = run_vserve(LLAMA3_8B, p, [512], max_num_seqs=8, enforce_eager=False)
    results["8b_bs1_in128_out128_hf_generate"] = hf_generate_bs1(LLAMA3_8B, p[0], 128)


def hf_generate_bs1(cfg: dict, prompt: list[int], out_len: int) -> dict:
    """The peer at batch 1: HF `generate`, greedy, dynamic cache (its static-cache compile path failed there)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = out.shape[1] - ids.shape[1]
    del model
    free_gpu()
    return dict(seconds=dt, output_tokens=n, output_tok_s=n / dt)


def section_smollm2(results: dict) -> None:
    """The embedded SmolLM2 GGUF on the GPU in bf16, greedy, on the prompts whose CPU float32 tokens are in
    benchmarks/smollm2_cpu_reference.json (compared, with logit gaps at any divergence, on the CPU after)."""
    from vserve import LLM, SamplingParams

    ref = json.loads((Path(__file__).parent / "smollm2_cpu_reference.json").read_text())
    llm = LLM(os.environ["VSERVE_SMOLLM2_GGUF"], dtype="bfloat16", max_model_len=2048, skip_tokenizer_init=True)
    outs = llm.generate(ref["prompt_ids"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    results["smollm2_gpu_bf16_tokens"] = got
    results["smollm2_equal_to_cpu_fp32"] = [g == r for g, r in zip(got, ref["cpu_fp32_tokens"])]
    del llm
    free_gpu()


def section_small(results: dict) -> None:
    for name, cfg in (("smollm2_shape", SMOLLM2), ("qwen2.5_0.5b_shape", QWEN25_05B)):
        p, _ = workload(256, 0, cfg["vocab_size"], (512, 512))
        results[f"{name}_out_512"] = run_vserve(cfg, p, [512] * 256, max_num_seqs=256, enforce_eager=False)


def section_profile(results: dict, out: Path) -> None:
    """Per-step wall times of the 8B U[100,1024] run by step kind, and a torch profile of 5 decode steps at full
    batch: where a step's time goes (GPU kernels vs host) before tuning."""
    from torch.profiler import ProfilerActivity, profile

    from vserve import LLM, SamplingParams

    p, o = workload(256, 0, LLAMA3_8B["vocab_size"], (100, 1024))
    llm = LLM(model_dir(LLAMA3_8B), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_num_seqs=256, enforce_eager=False)
    llm.generate(p[:4], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    eng = llm.llm_engine
    for i, (pr, n) in enumerate(zip(p, o)):
        eng.add_request(str(i), pr, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True))
    steps, i, prof = [], 0, None
    torch.cuda.synchronize()
    t_all = time.perf_counter()
    while eng.has_unfinished_requests():
        running = len(eng.scheduler.running)
        if i == 200:
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        eng.step(finished_only=True)
        steps.append((time.perf_counter() - t0, eng.last_step_tokens, running))
        if i == 204:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            (out / "profile_8b_decode.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=40) + "\n\n"
                + prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        i += 1
    total = time.perf_counter() - t_all
    dec = [s for s in steps if s[1] == s[2]]
    mixed = [s for s in steps if s[1] != s[2]]
    buckets = {}
    for dt, tok, _ in dec:
        buckets.setdefault(min(tok // 32 * 32, 256), []).append(dt)
    results["profile_8b"] = dict(
        seconds=total, steps=len(steps), decode_steps=len(dec), mixed_steps=len(mixed),
        decode_s=sum(s[0] for s in dec), mixed_s=sum(s[0] for s in mixed),
        decode_ms_by_batch={k: (len(v), 1e3 * sum(v) / len(v)) for k, v in sorted(buckets.items())},
        first_steps_ms=[round(1e3 * s[0], 2) for s in steps[:12]], steps_200_210=[
            (round(1e3 * s[0], 2), s[1]) for s in steps[200:210]])
    del llm, eng, prof
    free_gpu()


def profile_steps(eng, prompts, outs, first: int, n: int):
    """Add the requests (sampled, eos ignored), run `first` engine steps, then n more under a profile of CUDA
    activity only (no host-op recording, so the host loop runs as it does unprofiled): (profile, wall seconds of
    the n steps, requests running after them)."""
    from torch.profiler import ProfilerActivity, profile

    from vserve import SamplingParams

    for i, (pr, o) in enumerate(zip(prompts, outs)):
        eng.add_request(str(i), pr, SamplingParams(temperature=1.0, max_tokens=o, ignore_eos=True))
    for _ in range(first):
        eng.step(finished_only=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step(finished_only=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall, len(eng.scheduler.running)


def gpu_busy_fraction(cfg: dict, prompts, outs, first: int = 100, n: int = 20) -> dict:
    """Steady-state decode: the fraction of wall time the GPU runs kernels, over n steps from step `first`."""
    from vserve import LLM

    llm = LLM(model_dir(cfg), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=256)
    eng = llm.llm_engine
    prof, wall, running = profile_steps(eng, prompts, outs, first, n)
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    del llm, eng, prof
    free_gpu()
    return dict(steps=n, wall_s=wall, gpu_kernel_s=busy, busy_fraction=busy / wall, batch=running)


def section_small_peer(results: dict) -> None:
    """Small shapes, 256 requests, prompts U[100,1024], 128 new tokens each (a shorter run than section small's
    512, so HF `generate_batch` fits the device time): vserve and HF in the same run, and vserve's GPU busy
    fraction in steady decode."""
    for name, cfg in (("smollm2_shape", SMOLLM2), ("qwen2.5_0.5b_shape", QWEN25_05B)):
        p, _ = workload(256, 0, cfg["vocab_size"], (128, 128))
        results[f"{name}_out_128"] = run_vserve(cfg, p, [128] * 256, max_num_seqs=256, enforce_eager=False)
        results[f"{name}_out_128_hf_generate_batch"] = hf_generate_batch(cfg, p, 128)
        results[f"{name}_busy"] = gpu_busy_fraction(cfg, p, [128] * 256, first=40)


STARTUP = """
import time, sys
t0 = float(sys.argv[2])
from vserve import LLM, SamplingParams
llm = LLM(sys.argv[1], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=256)
out = llm.generate([[5] * 16], SamplingParams(max_tokens=1), use_tqdm=False)
print("FIRST_TOKEN_S", time.time() - t0)
"""


def section_startup(results: dict) -> None:
    d = model_dir(LLAMA3_8B)
    cache = tempfile.mkdtemp(prefix="triton-cache-")
    for label in ("empty_triton_cache", "warm_triton_cache"):
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "VSERVE_NO_PROGRESS": "1"}
        r = subprocess.run([sys.executable, "-c", STARTUP, d, str(time.time())], env=env, capture_output=True,
                           text=True, timeout=300)
        line = [x for x in r.stdout.splitlines() if x.startswith("FIRST_TOKEN_S")]
        results[f"startup_8b_{label}_s"] = float(line[0].split()[1]) if line else r.stderr[-2000:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sections", default="correct,throughput,bs1,small,startup")
    ap.add_argument("--hf-peer", action="store_true")
    args = ap.parse_args()
    results: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    out = Path(args.out)
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            if name == "throughput":
                section_throughput(results, args.hf_peer)
            elif name == "profile":
                section_profile(results, out)
            else:
                globals()[f"section_{name}"](results)
        except Exception as e:  # keep the other sections' numbers
            import traceback

            results[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"section {name} failed: {e!r}", flush=True)
        results[f"{name}_section_s"] = time.perf_counter() - t0
        (out / "h200_engine.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
