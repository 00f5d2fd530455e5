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
    GEMMA2_2B,
    GEMMA2_9B,
    LLAMA3_8B,
    PHI3_MINI,
    TINY,
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sections", default="correct,correct32,smollm2")
    ap.add_argument("--shapes", default="8b", help=f"the correct sections' shapes, of {', '.join(SHAPES)}")
    ap.add_argument("--cpu-smoke", action="store_true", help="the checks on the CPU in float32, a tiny 8B-like shape")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        torch.set_num_threads(1)
        device, shapes, low = "cpu", {"8b": TINY}, torch.float32
    elif torch.cuda.is_available():
        device, low = "cuda", torch.bfloat16
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    else:
        print("h200_engine.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    sections = {"smollm2": lambda r: section_smollm2(r, device, "float32" if args.cpu_smoke else "bfloat16")}
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
    if "smollm2_equal_to_cpu_fp32" in res:
        print(f"smollm2 equal to the CPU float32 tokens: {res['smollm2_equal_to_cpu_fp32']}")
    return 1 if any(k.endswith("_error") for k in res) else 0


if __name__ == "__main__":
    sys.exit(main())
