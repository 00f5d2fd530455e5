"""Decode attention over an fp8 e4m3 KV cache against the bf16 cache on the H200: the launch grid of
kernels/gpu_check.py's decode bench (Llama-3-8B heads, contexts of 4096, batch 8 and 64), fastest first.

    python benchmarks/fp8_kv_decode.py --out $OUT     # ~2 min; writes OUT/fp8_kv_decode.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_kv_decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from vserve.kernels import gpu_check as g

    rows = g.bench_decode("llama3-8b", g.MODELS["llama3-8b"], torch.bfloat16, "cuda", tiny=False, sweep=True)
    rows = [r for r in rows if r.ms is not None and "bs=16" in r.case]
    rows.sort(key=lambda r: (r.case, r.ms))
    table = g.format_table(g.BENCH_HEADER, [r.cells() for r in rows])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fp8_kv_decode.md").write_text(table + "\n")
    for case in dict.fromkeys(r.case for r in rows):
        best = [r for r in rows if r.case == case][:3]
        print(case, " | ".join(f"{r.impl}: {r.ms:.3f} ms" for r in best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
