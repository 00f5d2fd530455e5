"""Decode attention under the engine's conditions, on a GPU: contexts of mixed lengths, and the block table as
wide as the CUDA graphs capture it (max_model_len / block_size), where kernels/gpu_check.py times equal
contexts in a table just wide enough. Sweeps launch configs (paged_decode_attention's keywords) over a bf16 and an
fp8 e4m3 cache; checks each against the float32 reference on the same cached values; writes the fastest config per
case to OUT/decode_sweep.json.

    python benchmarks/kernels/decode_sweep.py --out $OUT                    # ~4 min
    python benchmarks/kernels/decode_sweep.py --out $OUT --kv-dtypes fp8 --cases 240:400:1400
    python benchmarks/kernels/decode_sweep.py --out $OUT --grid combine --kv-dtypes bf16 --cases 1:128:640,64:900:1800
    python benchmarks/kernels/decode_sweep.py --cpu-smoke --out /tmp/ds     # tiny heads, TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from functools import partial
from pathlib import Path

import torch

KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp16": torch.float16}


def grid() -> list[dict]:
    """Launch configs: partition length, KV tile, warps, pipeline stages (the block-table gather takes stages
    before the K/V copies are double-buffered: 2 buffers from num_stages 5 on, as seen in the compiled TTGIR)."""
    return [dict(partition_size=p, block_n=n, num_warps=w, num_stages=s)
            for p, n, w, s in itertools.product((512, 1024, 2048), (32, 64, 128), (4, 8), (2, 3, 4, 5))
            if not (w == 8 and (n == 32 or s > 3))]


# fp8 cache: the occupancy candidates (registers capped by maxnreg so that 4-5 programs fit an SM; compiled for
# sm_90a on the CPU: no spills, shared memory 22-56 KB)
SMALL_GRID = [dict(partition_size=2048, block_n=n, num_warps=4, num_stages=s, maxnreg=r)
              for n, s, r in ((128, 2, None), (128, 1, None), (128, 1, 128), (64, 2, None), (64, 2, 128),
                              (64, 2, 96), (64, 5, 128), (64, 1, 128), (32, 2, 96))]


# the partials combined by the last partition to finish (the default) or by the reduce kernel, at each partition
# length, then the two at the default partition again
REDUCE_GRID = [dict(partition_size=p, fused_reduce=f) for p in (512, 1024, 2048) for f in (True, False)] + \
    [dict(fused_reduce=f) for f in (False, True)]

# the partials combined 1 to 16 partitions per round of loads (the default: 1 below 64 (sequence, kv head) pairs,
# 4 for the 8B shape from there), at the default partitions
COMBINE_GRID = [dict(combine_chunk=c) for c in (1, 2, 4, 8, 16)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtypes", default="bf16,fp8")
    ap.add_argument("--grid", choices=("full", "small", "reduce", "combine"), default="full")
    ap.add_argument("--cases", default="240:400:1400,64:900:1800", help="B:lo:hi, comma-separated")
    from timing import parse_args

    args = parse_args(ap, argv, "tiny heads and contexts on the CPU, TRITON_INTERPRET=1")
    if args is None:
        return 2
    from timing import smoke_iters, time_ms

    from vserve.kernels import triton_attention as tri
    from vserve.kernels.gpu_check import _paged
    from vserve.kernels.paged_attention import paged_decode_attention_ref

    H, kvh, d, dtype, dev = 32, 8, 128, torch.bfloat16, "cuda"  # the Llama-3-8B shape
    configs = {"full": grid, "small": lambda: SMALL_GRID, "reduce": lambda: REDUCE_GRID,
               "combine": lambda: COMBINE_GRID}[args.grid]()
    if args.cpu_smoke:  # two launches of the grid over a small table: the script's steps, nothing measured
        H, kvh, d, dtype, dev, configs = 4, 2, 32, torch.float16, "cpu", REDUCE_GRID[:2]
        args.max_model_len, args.cases, args.kv_dtypes = 256, "3:20:100", "fp16"
    timing = smoke_iters(args.cpu_smoke)
    rng = random.Random(0)
    rows, best = [], {}
    bs = args.block_size
    width = args.max_model_len // bs
    for case in args.cases.split(","):
        B, lo, hi = map(int, case.split(":"))
        ctx = [rng.randint(lo, hi) for _ in range(B)]
        k_cache, v_cache, bt, ctx_lens = _paged(ctx, bs, kvh, d, dtype, dev)
        full = torch.zeros(B, width, dtype=torch.int32, device=dev)
        full[:, :bt.shape[1]] = bt
        q = torch.randn(B, H, d, dtype=dtype, device=dev)
        for name in args.kv_dtypes.split(","):
            kc, vc = k_cache.to(KV_DTYPES[name]), v_cache.to(KV_DTYPES[name])
            ref = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), bt, ctx_lens, d**-0.5)
            nbytes = 2 * sum(ctx) * kvh * d * kc.element_size()
            key = f"{name} B={B} U[{lo},{hi}]"
            # untimed first pass: the first launch timed in a case came out 3-6% slower than the same launch
            # timed later in the grid (clocks and caches settling)
            time_ms(partial(tri.paged_decode_attention, q, kc, vc, full, ctx_lens, d**-0.5), dev, **timing)
            for cfg in [{}] + configs:
                try:
                    out = torch.full_like(q, float("nan"))
                    fn = partial(tri.paged_decode_attention, q, kc, vc, full, ctx_lens, d**-0.5, out=out, **cfg)
                    fn()
                    err = float((out.float() - ref).abs().max())
                    ms = time_ms(fn, dev, **timing)
                    rows.append(dict(case=key, cfg=cfg or "default", ms=ms, tb_s=nbytes / ms / 1e9, max_err=err))
                except Exception as e:  # a config that does not fit: keep the others
                    rows.append(dict(case=key, cfg=cfg, error=str(e)[:200]))
            good = sorted((r for r in rows if r["case"] == key and "ms" in r and r["max_err"] < 0.05),
                          key=lambda r: r["ms"])
            dflt = next(r for r in rows if r["case"] == key and r["cfg"] == "default")
            best[key] = good[0]
            print(f"{key}: default {dflt.get('ms', float('nan')):.3f} ms {dflt.get('tb_s', 0):.2f} TB/s; best "
                  + "; ".join(f"{r['cfg']} {r['ms']:.3f} ms {r['tb_s']:.2f} TB/s err {r['max_err']:.3g}"
                              for r in good[:3]), flush=True)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, "decode_sweep.json").write_text(json.dumps(dict(rows=rows, best=best), indent=1))
            del kc, vc
    return 0


if __name__ == "__main__":
    sys.exit(main())
