"""The engine on the GPU against its references: greedy tokens of vserve beside HF transformers on the same random
weights, and beside the CPU float32 path on the embedded SmolLM2. Run on the H200:

    python benchmarks/h200_engine.py --out $OUT [--sections correct,correct32,smollm2]
    python benchmarks/h200_engine.py --cpu-smoke --out /tmp/h200_engine     # the same checks, tiny shape, CPU float32

- correct: a random Llama-3-8B-shape HF checkpoint (written once, safetensors) served by vserve in bf16 and run by
  HF transformers in bf16, 4 prompts x 32 greedy tokens: where they first differ, and HF's own logit gap between the
  two candidates there (random weights make near-ties common: bf16 divergences at gaps below bf16's resolution are
  rounding, not a bug).
- correct32: the same in float32 (TF32 off), where rounding noise is ~1e-6 of a logit: the tokens should be equal.
  --shapes 8b,gemma2_9b,gemma2_2b,phi3_mini runs both for each shape (Gemma-2-9B/2B, Phi-3-mini-128k: issue #25).
- smollm2: the embedded SmolLM2 (VSERVE_SMOLLM2_GGUF, else the default model) in bf16 on the GPU, greedy, against
  the CPU float32 tokens of smollm2_cpu_reference.json (on the CPU, float32: they should be equal).
- mla_graphs (not run unless named; issue #26): DeepSeek-V2 models decode eagerly (DeepseekV2ForCausalLM.cuda_graphs
  is False) until their decode step has been checked in a CUDA graph. The DeepSeek-V2-Lite shape at 8 of its 27
  layers, dummy weights (one seed), the engine in this process: greedy tokens with graphs forced on against eager in
  float32 (TF32 off; 3 and 8 prompts, so padded graph sizes run too), then bf16 decode tok/s of both at batch 1 and 32.
Throughput rows are h200_rows.py's (through the CLI); this script only compares tokens. JSON: OUT/h200_engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from common import (  # benchmarks/ is sys.path[0]
    DEEPSEEK_V2_LITE,
    GEMMA2_2B,
    GEMMA2_9B,
    LLAMA3_8B,
    PHI3_MINI,
    TINY,
    TINY_DEEPSEEK_V2,
    free_gpu,
    hf_config,
    model_folder,
    workload,
)

SHAPES = {"8b": LLAMA3_8B, "gemma2_9b": GEMMA2_9B, "gemma2_2b": GEMMA2_2B, "phi3_mini": PHI3_MINI}

REFERENCE = Path(__file__).parent / "smollm2_cpu_reference.json"


def section_correct(res: dict, cfg: dict, device: str, dtype: torch.dtype, key: str) -> None:
    """Greedy vserve against HF transformers on one random HF checkpoint of cfg's shape, in dtype."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from vserve import LLM, SamplingParams

    hf_logging.disable_progress_bar()
    folder = model_folder(cfg)
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=dtype).eval()
    hf.save_pretrained(folder, safe_serialization=True)  # vserve reads it through its own loader
    hf.to("cpu")  # one fp32 9B model at a time on the GPU (37 GB each): the check fits an 80 GB card
    free_gpu()
    prompts, _ = workload(4, 1, cfg["vocab_size"], (32, 32), in_len=(20, 200))
    llm = LLM(folder, dtype=str(dtype).removeprefix("torch."), device=device, max_model_len=1024)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32,
                                                                                 ignore_eos=True), use_tqdm=False)]
    llm.llm_engine.shutdown()
    del llm
    free_gpu()
    hf.to(device)
    rows = []
    with torch.inference_mode():
        for p, g in zip(prompts, got):
            ids = torch.tensor([p], device=device)
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            div = next((i for i in range(32) if ref[i] != g[i]), None)
            gap = None
            if div is not None:  # HF's logit gap between the two candidates at the divergence
                logits = hf(torch.tensor([p + ref[:div]], device=device)).logits[0, -1].float()
                gap = float(logits[ref[div]] - logits[g[div]])
            rows.append(dict(prompt_len=len(p), equal=div is None, first_divergence=div, hf_logit_gap=gap))
    res[key] = rows
    del hf
    free_gpu()


def section_smollm2(res: dict, device: str, dtype: str) -> None:
    """The embedded SmolLM2, greedy, 24 tokens of each reference prompt, against the CPU float32 tokens."""
    from vserve import LLM, SamplingParams

    ref = json.loads(REFERENCE.read_text())
    llm = LLM(os.environ.get("VSERVE_SMOLLM2_GGUF"), dtype=dtype, device=device, max_model_len=2048)
    outs = llm.generate(ref["prompt_ids"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    llm.llm_engine.shutdown()
    got = [o.outputs[0].token_ids for o in outs]
    res["smollm2_tokens"] = got
    res["smollm2_equal_to_cpu_fp32"] = [g == r for g, r in zip(got, ref["cpu_fp32_tokens"])]
    del llm
    free_gpu()


def section_mla_graphs(res: dict, cfg: dict, device: str) -> None:
    """Greedy tokens and decode speed of an MLA model with CUDA graphs forced on, against eager (see the docstring)."""
    from vserve import LLM, SamplingParams
    from vserve.core.models.deepseek_v2 import DeepseekV2ForCausalLM

    folder = model_folder(cfg)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts, _ = workload(8, 2, cfg["vocab_size"], (32, 32), in_len=(20, 300))

    def with_engine(graphs: bool, dtype: str, fn):
        """fn(llm) on an engine with graphs forced on or off, shut down and its GPU memory freed after."""
        DeepseekV2ForCausalLM.cuda_graphs = graphs  # read by the model runner at start (the engine runs in process)
        llm = LLM(folder, load_format="dummy", dtype=dtype, device=device, max_model_len=1024, max_num_seqs=32,
                  engine_process=False, enforce_eager=not graphs)
        try:
            return fn(llm)
        finally:
            llm.llm_engine.shutdown()
            del llm
            free_gpu()

    def tokens(llm, batch):
        return [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]

    def tok_s(llm, n, new):
        batch = [p[:128] for p in (prompts * 4)[:n]]
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
        return n * new / (time.perf_counter() - t0)

    tf32, default = torch.backends.cuda.matmul.allow_tf32, DeepseekV2ForCausalLM.cuda_graphs
    torch.backends.cuda.matmul.allow_tf32 = False
    got, speed = {}, {}
    try:
        for graphs in (False, True):
            got[graphs] = with_engine(graphs, "float32", lambda llm: [tokens(llm, prompts[:3]), tokens(llm, prompts)])
        torch.backends.cuda.matmul.allow_tf32 = tf32
        new = 64 if device == "cpu" else 256
        for graphs in (False, True):
            speed["graphs" if graphs else "eager"] = with_engine(
                graphs, "float32" if device == "cpu" else "bfloat16",
                lambda llm: {f"batch_{n}_tok_s": tok_s(llm, n, new) for n in (1, 32)})
    finally:
        DeepseekV2ForCausalLM.cuda_graphs = default
        torch.backends.cuda.matmul.allow_tf32 = tf32
    rows = [dict(batch=len(e), prompt=i, equal=a == b, first_divergence=next((j for j, (x, y) in enumerate(zip(a, b))
                                                                              if x != y), None))
            for e, g in zip(got[False], got[True]) for i, (a, b) in enumerate(zip(e, g))]
    res["mla_graphs_vs_eager_fp32"] = rows
    res["mla_graphs_decode"] = speed
    res["mla_graphs_layers"] = cfg["num_hidden_layers"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sections", default=None,
                    help="comma-separated (default: correct,correct32,smollm2; --cpu-smoke adds mla_graphs)")
    ap.add_argument("--shapes", default="8b", help=f"the correct sections' shapes, of {', '.join(SHAPES)}")
    ap.add_argument("--cpu-smoke", action="store_true", help="the checks on the CPU in float32, a tiny 8B-like shape")
    args = ap.parse_args(argv)
    args.sections = args.sections or "correct,correct32,smollm2" + (",mla_graphs" if args.cpu_smoke else "")
    if args.cpu_smoke:
        torch.set_num_threads(1)
        device, shapes, low = "cpu", {"8b": TINY}, torch.float32
    elif torch.cuda.is_available():
        device, low = "cuda", torch.bfloat16
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    else:
        print("h200_engine.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    sections = {"smollm2": lambda r: section_smollm2(r, device, "float32" if args.cpu_smoke else "bfloat16"),
                "mla_graphs": partial(section_mla_graphs, device=device, cfg=TINY_DEEPSEEK_V2 if args.cpu_smoke else
                                      dict(DEEPSEEK_V2_LITE, num_hidden_layers=8))}
    for name, cfg in shapes.items():  # keys: correct_vs_hf[_fp32] for the 8B shape, ..._SHAPE for the others
        tag = "" if name == "8b" else f"_{name}"
        sections[f"correct{tag}"] = partial(section_correct, cfg=cfg, device=device, dtype=low,
                                            key=f"correct_vs_hf{tag}")
        sections[f"correct32{tag}"] = partial(section_correct, cfg=cfg, device=device, dtype=torch.float32,
                                              key=f"correct_vs_hf_fp32{tag}")
    if args.cpu_smoke:  # float32 already: correct32 would repeat correct
        sections.pop("correct32")
    # correct and correct32 name every shape's sections
    names = [n for base in args.sections.split(",") for n in sections
             if n == base or (n.startswith(base + "_") and n.removeprefix(base + "_") in shapes)]
    res: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.perf_counter()
        try:
            sections[name](res)
        except Exception as e:  # keep the other sections' results
            res[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"section {name} failed: {e!r}", flush=True)
        res[f"{name}_section_s"] = round(time.perf_counter() - t0, 2)
        (out / "h200_engine.json").write_text(json.dumps(res, indent=1))
    for key in [k for k in res if k.startswith("correct_vs_hf")]:
        if isinstance(res[key], list):
            print(f"{key}: {sum(r['equal'] for r in res[key])}/{len(res[key])} prompts equal; first divergences "
                  f"{[r['first_divergence'] for r in res[key]]}, HF logit gaps {[r['hf_logit_gap'] for r in res[key]]}")
    if "mla_graphs_vs_eager_fp32" in res:
        rows = res["mla_graphs_vs_eager_fp32"]
        print(f"MLA with CUDA graphs == eager (float32): {sum(r['equal'] for r in rows)}/{len(rows)} prompts; decode "
              f"tok/s {res['mla_graphs_decode']}")
    if "smollm2_equal_to_cpu_fp32" in res:
        print(f"smollm2 equal to the CPU float32 tokens: {res['smollm2_equal_to_cpu_fp32']}")
    return 1 if any(k.endswith("_error") for k in res) else 0


if __name__ == "__main__":
    sys.exit(main())
