"""Decode attention under the engine's conditions, on a GPU: contexts of mixed lengths, and the block table as
wide as the CUDA graphs capture it (max_model_len / block_size), where kernels/gpu_check.py times equal
contexts in a table just wide enough. Sweeps launch configs; checks each against the reference.

    python benchmarks/decode_sweep.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from functools import partial
from pathlib import Path

import torch

from vserve.kernels import triton_attention as tri
from vserve.kernels.gpu_check import _paged, time_ms
from vserve.kernels.paged_attention import paged_decode_attention_ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--max-model-len", type=int, default=8192)
    args = ap.parse_args()
    H, kvh, d, dtype = 32, 8, 128, torch.bfloat16  # the Llama-3-8B shape
    rng = random.Random(0)
    rows = []
    for bs in (16, 64):
        width = args.max_model_len // bs
        for B, lo, hi in ((16, 1200, 2000), (64, 900, 1800), (128, 700, 1600), (240, 400, 1400)):
            ctx = [rng.randint(lo, hi) for _ in range(B)]
            k_cache, v_cache, bt, ctx_lens = _paged(ctx, bs, kvh, d, dtype, "cuda")
            full = torch.zeros(B, width, dtype=torch.int32, device="cuda")
            full[:, :bt.shape[1]] = bt
            q = torch.randn(B, H, d, dtype=dtype, device="cuda")
            ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), bt, ctx_lens, d**-0.5)
            nbytes = 2 * sum(ctx) * kvh * d * 2
            configs = [{}] + [dict(partition_size=p, block_n=n, num_warps=w, num_stages=s)
                              for p, n, w, s in itertools.product((512, 1024, 2048, args.max_model_len), (32, 64),
                                                                  (4, 8), (2, 3, 4))]
            for cfg in configs:
                try:
                    out = torch.full_like(q, float("nan"))
                    fn = partial(tri.paged_decode_attention, q, k_cache, v_cache, full, ctx_lens, d**-0.5, out=out,
                                 **cfg)
                    fn()
                    err = float((out.float() - ref).abs().max())
                    ms, graphed = time_ms(fn, "cuda")
                    rows.append(dict(bs=bs, B=B, ctx=f"U[{lo},{hi}]", cfg=cfg or "default", ms=ms,
                                     tb_s=nbytes / ms / 1e9, max_err=err, graphed=graphed))
                except Exception as e:  # a config that does not fit: keep the others
                    rows.append(dict(bs=bs, B=B, cfg=cfg, error=str(e)[:200]))
            good = sorted((r for r in rows if r.get("bs") == bs and r.get("B") == B and "ms" in r),
                          key=lambda r: r["ms"])
            dflt = next(r for r in good if r["cfg"] == "default")
            print(f"bs={bs} B={B}: default {dflt['ms']:.3f} ms {dflt['tb_s']:.2f} TB/s; best "
                  + "; ".join(f"{r['cfg']} {r['ms']:.3f} ms {r['tb_s']:.2f} TB/s err {r['max_err']:.3g}"
                              for r in good[:3]), flush=True)
            Path(args.out, "decode_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
