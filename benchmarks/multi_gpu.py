"""Issue #9 in one call on a machine with several GPUs: tensor parallelism of the 8B shape and of a Mixtral-8x7B
shape, and vserve doctor there. Run it as

    PYTHONPATH=... python benchmarks/multi_gpu.py --out $OUT --tp 1,2        # nvidia-h200-x2, ~8 min
    PYTHONPATH=... python benchmarks/multi_gpu.py --out $OUT --tp 1,2,4      # nvidia-h200-x4
    python benchmarks/multi_gpu.py --cpu-smoke --out /tmp/mg                 # tiny shapes, gloo on 2 CPU ranks

Every model folder carries common.py's synthetic tokenizer, and the engine loads it, as users run it.

Sections (--sections, comma-separated):
- parity: a random 8B-shape HF checkpoint (bf16 safetensors, written once) served in float32 at each TP size;
  greedy tokens of 8 prompts x 32 tokens compared with TP=1's (dummy weights would differ between TP sizes:
  each rank draws its own shard);
- throughput: the 8B shape, bf16, dummy weights, 256 requests, prompts U[100,1024] of random tokens, outputs
  U[100,1024], ignore_eos, at each TP size (rank 0's peak memory beside the planner's);
- moe: the Mixtral-8x7B shape (dummy, bf16) at each TP size > 1 (and TP=1 when --moe-tp1: 93 GB of weights fit
  one H200): the same 256-request workload, and decode at batch 1 (prompt 128, 512 tokens);
- doctor: `vserve doctor MODEL -tp N --json` for both shapes at each TP size > 1: every check's status (GPU
  topology, NCCL, NCCL environment, /dev/shm) and the plan's torch peak against the measured one.

JSON to OUT/multi_gpu.json after every section; a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from common import LLAMA3_8B, MIXTRAL_8X7B, free_gpu, hf_config, model_folder, workload  # benchmarks/ is sys.path[0]

# --cpu-smoke's sizes for both shapes (bos and eos inside the small vocabulary)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def _gpu() -> bool:
    return torch.cuda.is_available()


def _engine_args(smoke: bool) -> dict:
    return dict(device="cpu", num_kv_blocks=512) if smoke else {}


def _serve(folder: str, prompts, outs, tp: int, smoke: bool, greedy: bool = False, **args) -> dict:
    """Generate outs[i] tokens for prompts[i] (ignore_eos; greedy or temperature 1) with engine args; time, tokens,
    the planned peak memory of rank 0 and, when rank 0 runs in this process, the measured one."""
    from vserve import LLM, SamplingParams

    llm = LLM(folder, tensor_parallel_size=tp, **{**_engine_args(smoke), **args})
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        sps = [SamplingParams(temperature=0 if greedy else 1.0, max_tokens=o, ignore_eos=True) for o in outs]
        if _gpu():
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = llm.generate(prompts, sps, use_tqdm=False)
        if _gpu():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n = sum(len(r.outputs[0].token_ids) for r in res)
        assert n == sum(outs), (n, sum(outs))
        engine = llm.llm_engine
        in_process = _gpu() and engine.core is not None  # rank 0 in this process: its peak is measured here
        return dict(tp=tp, seconds=dt, output_tokens=n, output_tok_s=n / dt,
                    tokens=[r.outputs[0].token_ids for r in res],
                    rank0_torch_peak=torch.cuda.max_memory_allocated() if in_process else None,
                    plan_torch_peak=engine.info.memory_plan.get("torch_peak_bytes"),
                    kv_blocks=engine.stats().num_blocks)
    finally:
        llm.llm_engine.shutdown()
        del llm
        free_gpu()


def section_parity(res: dict, tps: list[int], smoke: bool) -> None:
    from transformers import AutoModelForCausalLM

    cfg = dict(LLAMA3_8B, **TINY) if smoke else LLAMA3_8B
    folder = Path(model_folder(cfg))
    torch.manual_seed(0)
    with torch.device("cuda" if _gpu() else "cpu"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    free_gpu()
    rng = random.Random(1)
    prompts = [[rng.randrange(10, cfg["vocab_size"] - 10) for _ in range(rng.randint(20, 200))] for _ in range(8)]
    runs = {}
    for tp in tps:
        runs[tp] = _serve(str(folder), prompts, [32] * len(prompts), tp, smoke, dtype="float32", greedy=True)
    base = runs[tps[0]]["tokens"]
    res["parity"] = {f"tp{tp}": dict(equal_prompts=sum(a == b for a, b in zip(r["tokens"], base)), prompts=len(base),
                                     first_divergence=[next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                                       for a, b in zip(r["tokens"], base)])
                     for tp, r in runs.items()}


def section_runs(res: dict, key: str, cfg: dict, tps: list[int], smoke: bool, bs1: bool = False) -> None:
    """cfg's shape (dummy weights) at each TP size: the 256-request workload, or with bs1 one request (prompt 128,
    512 tokens)."""
    if bs1:
        n, seed, lens, seqs = 1, 3, ((16, 16), (8, 8)) if smoke else ((512, 512), (128, 128)), 8
    else:
        n, seed, lens, seqs = (8, 0, ((4, 12), (4, 20)), 16) if smoke else (256, 0, ((100, 1024), (100, 1024)), 256)
    p, o = workload(n, seed, cfg["vocab_size"], lens[0], in_len=lens[1])
    folder = model_folder(cfg)
    tag = "_bs1" if bs1 else ""
    for tp in tps:
        r = _serve(folder, p, o, tp, smoke, load_format="dummy", dtype="float32" if smoke else "bfloat16",
                   max_num_seqs=seqs)
        r.pop("tokens")
        res[f"{key}{tag}_tp{tp}"] = r
        print(f"{key}{tag} TP={tp}: {r['output_tok_s']:.1f} tok/s", flush=True)


def section_doctor(res: dict, tps: list[int], smoke: bool) -> None:
    for name, cfg in (("llama3_8b", LLAMA3_8B), ("mixtral_8x7b", MIXTRAL_8X7B)):
        folder = model_folder(dict(cfg, **TINY) if smoke else cfg)
        for tp in tps:
            cmd = [sys.executable, "-m", "vserve.cli.main", "doctor", folder, "-tp", str(tp), "--json"]
            if smoke:
                cmd += ["--profile", "h200"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            try:
                rep = json.loads(out.stdout)
            except json.JSONDecodeError:
                rep = dict(error=(out.stdout + out.stderr)[-2000:])
            res[f"doctor_{name}_tp{tp}"] = dict(rep, exit_code=out.returncode)
            checks = rep.get("checks", [])
            print(f"doctor {name} TP={tp}: exit {out.returncode}; " +
                  ", ".join(f"{c.get('name')} {c.get('status')}" for c in checks), flush=True)


def summary(res: dict) -> str:
    lines = []
    for tp, r in res.get("parity", {}).items():
        lines.append(f"parity {tp} vs TP=1: {r['equal_prompts']}/{r['prompts']} prompts token-identical, "
                     f"first divergence {r['first_divergence']}")
    for k, v in res.items():
        if isinstance(v, dict) and "output_tok_s" in v:
            peak = v.get("rank0_torch_peak")
            plan = v.get("plan_torch_peak")
            mem = f", rank 0 peak {peak / 2**30:.1f} GiB, plan {plan / 2**30:.1f} GiB" if peak and plan else ""
            lines.append(f"{k}: {v['output_tok_s']:.1f} tok/s ({v['output_tokens']} tokens in {v['seconds']:.1f} s"
                         f"{mem})")
        if k.startswith("doctor_") and isinstance(v, dict):
            bad = [c for c in v.get("checks", []) if c.get("status") in ("fail", "warn")]
            lines.append(f"{k}: exit {v.get('exit_code')}, " +
                         ("all checks ok" if not bad else "; ".join(f"{c['name']} {c['status']}: {c['finding']}"
                                                                     for c in bad)))
        if k.endswith("_error"):
            lines.append(f"{k}: {str(v).strip().splitlines()[-1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--tp", default="1,2", help="TP sizes, comma-separated (1 first: the reference)")
    ap.add_argument("--sections", default="parity,throughput,moe,doctor")
    ap.add_argument("--moe-tp1", action="store_true", help="also run the Mixtral shape on one GPU")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (gloo), to check the script")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    if smoke:
        os.environ.setdefault("VSERVE_NO_PROGRESS", "1")
        torch.set_num_threads(1)
    elif not _gpu():
        print("multi_gpu.py needs CUDA GPUs (or --cpu-smoke)", file=sys.stderr)
        return 2
    tps = [int(t) for t in args.tp.split(",")]
    multi = [t for t in tps if t > 1]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llama = dict(LLAMA3_8B, **TINY) if smoke else LLAMA3_8B
    mixtral = dict(MIXTRAL_8X7B, **TINY) if smoke else MIXTRAL_8X7B
    moe_tps = ([1] if args.moe_tp1 else []) + multi
    sections = {"parity": lambda r: section_parity(r, tps, smoke),
                "throughput": lambda r: section_runs(r, "llama3_8b", llama, tps, smoke),
                "moe": lambda r: (section_runs(r, "mixtral_8x7b", mixtral, moe_tps, smoke),
                                  section_runs(r, "mixtral_8x7b", mixtral, moe_tps, smoke, bs1=True)),
                "doctor": lambda r: section_doctor(r, multi, smoke)}
    names = args.sections.split(",")
    res: dict = {"torch": torch.__version__, "gpus": torch.cuda.device_count() if _gpu() else 0,
                 "gpu": torch.cuda.get_device_name() if _gpu() else "cpu (smoke)", "tp": tps}
    for name in names:
        t0 = time.perf_counter()
        try:
            sections[name](res)
        except Exception as e:  # keep the other sections' numbers
            res[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"section {name} failed: {e!r}", flush=True)
        res[f"{name}_section_s"] = time.perf_counter() - t0
        (out / "multi_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    print(summary(res))
    return 1 if any(k.endswith("_error") for k in res) else 0


if __name__ == "__main__":
    sys.exit(main())
