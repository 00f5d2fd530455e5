"""MLA decode over the paged latent cache (kernels/triton_mla.py: the absorbed query through the split-KV paged
decode kernel) on the DeepSeek-V2-Lite attention shape (16 heads, latent 512 + RoPE 64, no-RoPE 128, v 128): checked
against kernels/mla_ref.py in bf16, then timed beside it, per layer, at decode batch sizes.

    python benchmarks/kernels/mla_decode.py --out $OUT                  # H200, a minute
    python benchmarks/kernels/mla_decode.py --cpu-smoke --out /tmp/mla  # tiny shapes, TRITON_INTERPRET=1

Context lengths U[100, 1536] (the moe rows' prompts + outputs), block size 16. Check: max |triton - ref| / max |ref|
(ref in fp32 on the same bf16 inputs) within 2e-2. Time: ms per layer of `triton` (store excluded) and `ref`, and
the latent cache bytes read per second by the Triton path (the cache rows of every sequence, 576 x 2 B each).
JSON: OUT/mla_decode.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

SHAPE = dict(H=16, nope=128, rope=64, v=128, r=512)  # DeepSeek-V2-Lite (V3: H=128)
BATCHES = [1, 8, 32, 64, 128, 256]
TOL = 2e-2


def inputs(B: int, shape: dict, dev: str, dtype, block: int = 16, ctx_range=(100, 1536), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(ctx_range[0], ctx_range[1] + 1, (B,), generator=g)
    per_seq = -(-int(ctx.max()) // block)
    bt = torch.randperm(B * per_seq, generator=g).view(B, per_seq)
    cache = torch.randn(B * per_seq, block, 1, shape["r"] + shape["rope"], generator=g).to(dtype)
    q_nope = torch.randn(B, shape["H"], shape["nope"], generator=g).to(dtype)
    q_pe = torch.randn(B, shape["H"], shape["rope"], generator=g).to(dtype)
    w_kv = (torch.randn(shape["H"], shape["nope"] + shape["v"], shape["r"], generator=g) * shape["r"] ** -0.5).to(dtype)
    return [t.to(dev) for t in (q_nope, q_pe, cache, bt, ctx, w_kv)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    from timing import parse_args, smoke_iters, time_ms

    args = parse_args(ap, argv, "tiny shapes on the CPU under TRITON_INTERPRET=1")
    if args is None:
        return 2
    from vserve.kernels import mla_ref, triton_mla

    if args.cpu_smoke:  # fp16: the interpreter's tl.dot on bf16 is wrong
        dev, dtype, shape, batches, ctx_range = "cpu", torch.float16, dict(H=4, nope=16, rope=16, v=16, r=32), \
            [1, 3], (5, 70)
    else:
        dev, dtype, shape, ctx_range = "cuda", torch.bfloat16, SHAPE, (100, 1536)
        batches = [int(b) for b in args.batches.split(",")]
    scale = (shape["nope"] + shape["rope"]) ** -0.5
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke: the numbers mean nothing)",
                 "shape": shape, "rows": []}
    bad = 0
    for B in batches:
        q_nope, q_pe, cache, bt, ctx, w_kv = inputs(B, shape, dev, dtype, ctx_range=ctx_range, seed=B)
        got = triton_mla.mla_decode_attention(q_nope, q_pe, cache, bt, ctx, w_kv, scale)
        want = mla_ref.mla_decode_attention_ref(q_nope.float(), q_pe.float(), cache.float(), bt, ctx, w_kv.float(),
                                                scale)
        err = float((got.float() - want).abs().max()) / max(float(want.abs().max()), 1e-30)
        timing = smoke_iters(args.cpu_smoke)
        row = dict(B=B, rel_err=err, ok=err <= TOL,
                   triton_ms=time_ms(partial(triton_mla.mla_decode_attention, q_nope, q_pe, cache, bt, ctx, w_kv,
                                             scale), dev, **timing),
                   ref_ms=time_ms(partial(mla_ref.mla_decode_attention_ref, q_nope, q_pe, cache, bt, ctx, w_kv,
                                          scale), dev, graph=False, **timing))
        row["triton_GBps"] = int(ctx.sum()) * cache.shape[-1] * cache.element_size() / (row["triton_ms"] * 1e-3) / 1e9
        bad += not row["ok"]
        res["rows"].append(row)
        print(f"B={B:<4} rel_err {err:.2e} {'ok' if row['ok'] else 'FAIL'}  triton {row['triton_ms']:.4f} ms "
              f"({row['triton_GBps']:.0f} GB/s of latents)  ref {row['ref_ms']:.4f} ms", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "mla_decode.json").write_text(json.dumps(res, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
