"""The W4A16 GEMM (kernels/triton_w4a16.py) on Llama-3-8B's four linear shapes: checked against its reference, then
timed beside bf16 F.linear at decode and prefill row counts, with the weights out of L2 (as a decode step finds them).

    python benchmarks/kernels/w4a16.py --out $OUT                           # H200, a few minutes
    python benchmarks/kernels/w4a16.py --out $OUT --rows 1,2,8,16 --grid    # + the launch grid of each path
    python benchmarks/kernels/w4a16.py --cpu-smoke --out /tmp/w4a16         # tiny shapes, TRITON_INTERPRET=1

Check: every layout the kernel takes (AWQ, GPTQ, GPTQ act-order, compressed-tensors pack) in bf16 and fp16 at each
row count: relative error against w4a16_gemm_ref within max(the dtype's tolerance, 2x cuBLAS's own error on the
dequantized weight), and AWQ bit-identical on a second call (the K-split partials are summed in a fixed order).
Time (AWQ, ms per GEMM): bf16 F.linear; w4a16_gemm as the engine calls it (`awq`); the paths it did not take at
that row count, forced through its keywords: dequantize + cuBLAS (dequant_m=1) below DEQUANT_M rows, the fused
kernels (dequant_m past the rows) from there, the AWQ GEMV (gemv_m) for up to AWQ_GEMV_ROWS rows, the tile kernel
where the GEMV is the default. --grid: the launch grid of the path the engine takes at that row count, fastest
first. Every variant is a keyword of w4a16_gemm; nothing in the kernel module is changed from here.
JSON: OUT/w4a16.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N): qkv, o, gate_up, down of Llama-3-8B
ROWS = [1, 2, 4, 8, 16, 24, 64, 96, 256, 2048]  # timed
CHECK_ROWS = [1, 2, 5, 16, 40, 256, 2048]  # each path: the GEMV (1, 2 rows), the tile kernel, tiled, dequant + cuBLAS
GROUP = 128
LAYOUTS = (("awq", False), ("gptq", False), ("gptq", True), ("pack", False))
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# Launch grids, by the path a row count takes (H200 sessions 19-22; docs/performance.md)
GEMV_GRID = [dict(block_m=1, block_n=bn, block_k=16, split_k=sk, num_warps=w, num_stages=st) for bn in (256, 512)
             for w in (8, 4, 2) for sk in (16, 32, 64) for st in (1, 3)]
TILE_GRID = [dict(block_m=16, block_n=bn, block_k=bk, split_k=sk, num_warps=w, num_stages=st)
             for bn, bk, w, sk, st in ((128, 128, 4, 8, 2), (128, 128, 8, 8, 2), (128, 128, 4, 8, 3),
                                       (128, 64, 4, 8, 2), (128, 64, 4, 8, 4), (128, 128, 4, 4, 2),
                                       (128, 128, 4, 16, 3), (256, 128, 8, 4, 2), (256, 64, 8, 8, 3))]
TILED_GRID = [dict(block_m=bm, block_n=bn, block_k=bk, split_k=sk, num_warps=w, num_stages=3) for bm in (32, 64, 128)
              for bn in (64, 128) for bk in (32, 64) for w in (4, 8) for sk in (1, 2)]


def w4_weight(layout: str, K: int, N: int, dev: str, act_order: bool = False):
    """Random valid checkpoint tensors of one [N, K] weight: (qweight, scales, qzeros, g_idx)."""
    from vserve.quantize.formats import pack_int32

    def rand32(*shape):
        return torch.randint(-2**31, 2**31, shape, dtype=torch.int64, device=dev).to(torch.int32)

    G = K // GROUP
    scales = (torch.rand(G, N, device=dev) * 2e-3 + 1e-3).half()
    if layout == "awq":
        return rand32(K, N // 8), scales, rand32(G, N // 8), None
    if layout == "gptq":
        g = torch.arange(K, device=dev, dtype=torch.int32) // GROUP
        return rand32(K // 8, N), scales, rand32(G, N // 8), g[torch.randperm(K, device=dev)] if act_order else None
    codes = torch.randint(0, 16, (N, K), dtype=torch.int32)
    return pack_int32(codes, 4).to(dev), scales.float().t().contiguous(), None, None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)


def check(dev: str, shapes, rows, dtypes) -> list[dict]:
    from vserve.kernels import triton_w4a16, w4a16_ref

    out = []
    for K, N in shapes:
        for layout, act in LAYOUTS:
            qw, s, z, g = w4_weight(layout, K, N, dev, act)
            w32 = w4a16_ref.dequantize_weight(qw, s, z, g, layout, 4, GROUP)
            for dtype in dtypes:
                for M in rows:
                    x = torch.randn(M, K, device=dev).to(dtype)
                    got = triton_w4a16.w4a16_gemm(x, qw, s, z, g, layout, 4, GROUP)
                    ref = w4a16_ref.w4a16_gemm_ref(x, qw, s, z, g, layout, 4, GROUP)
                    err, torch_err = rel_err(got, ref), rel_err(torch.nn.functional.linear(x, w32.to(dtype)), ref)
                    same = layout != "awq" or torch.equal(got, triton_w4a16.w4a16_gemm(x, qw, s, z, g, layout, 4,
                                                                                         GROUP))
                    out.append(dict(layout=layout + ("-act-order" if act else ""), K=K, N=N, M=M,
                                    dtype=str(dtype).removeprefix("torch."), rel_err=err, torch_rel_err=torch_err,
                                    deterministic=bool(same), ok=bool(err <= max(TOL[dtype], 2 * torch_err) and same)))
    return out


def grid_for(M: int, N: int) -> list[dict]:
    """The launch grid of the path w4a16_gemm takes for M AWQ rows of a weight N wide (none for cuBLAS)."""
    from vserve.kernels import triton_w4a16 as w4

    if M <= w4.AWQ_GEMV_M:
        return GEMV_GRID
    if M <= 16:
        return TILE_GRID
    return TILED_GRID if M < (w4.DEQUANT_M_WIDE if N >= w4.WIDE_N else w4.DEQUANT_M) else []


def other_paths(M: int, N: int) -> dict[str, dict]:
    """w4a16_gemm's keywords for each path it does not take for M AWQ rows of a weight N wide."""
    from vserve.kernels import triton_w4a16 as w4

    paths = {"fused": dict(dequant_m=1 << 30)} if M >= (w4.DEQUANT_M_WIDE if N >= w4.WIDE_N else w4.DEQUANT_M) \
        else {"dequant_cublas": dict(dequant_m=1)}
    if 2 <= M <= w4.AWQ_GEMV_M:
        paths["tile"] = dict(gemv_m=1)
    elif w4.AWQ_GEMV_M < M <= w4.AWQ_GEMV_ROWS:
        paths["gemv"] = dict(gemv_m=M)
    return paths


def time_rows(dev: str, shapes, rows, dtype, cold_bytes: int, grid_size: int | None, timing: dict) -> list[dict]:
    """ms per GEMM of each path at each shape and row count (weights cycled out of L2 unless cold_bytes is 0)."""
    from timing import copies, time_ms

    from vserve.kernels import triton_w4a16

    out = []
    for K, N in shapes:
        awq = copies(lambda K=K, N=N: w4_weight("awq", K, N, dev)[:3], K * N // 2, cold_bytes)
        bf16 = copies(lambda K=K, N=N: (torch.randn(N, K, device=dev, dtype=dtype) * 0.02,), K * N * 2, cold_bytes)
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=dtype)

            def gemm(qw, s, z, _x=x, **kw):
                triton_w4a16.w4a16_gemm(_x, qw, s, z, None, "awq", 4, GROUP, **kw)

            row = dict(K=K, N=N, M=M, bf16_ms=time_ms(partial(torch.nn.functional.linear, x), dev, bf16, **timing),
                       awq_ms=time_ms(gemm, dev, awq, **timing))
            for path, kw in other_paths(M, N).items():
                row[f"{path}_ms"] = time_ms(partial(gemm, **kw), dev, awq, **timing)
            if grid_size != 0:
                timed = []
                for cfg in grid_for(M, N)[:grid_size]:
                    try:
                        timed.append(dict(ms=time_ms(partial(gemm, dequant_m=1 << 30, **cfg), dev, awq, **timing),
                                          **cfg))
                    except Exception as e:  # out of shared memory or registers: keep the others
                        timed.append(dict(error=f"{type(e).__name__}: {str(e)[:120]}", **cfg))
                row["grid"] = sorted(timed, key=lambda t: t.get("ms", float("inf")))
            row["awq_vs_bf16"] = row["bf16_ms"] / row["awq_ms"]
            row["awq_TBps"] = (K * N / 2 + K // GROUP * N * 2.5) / (row["awq_ms"] * 1e-3) / 1e12
            out.append(row)
            best = (row.get("grid") or [{}])[0]
            print(f"{K:>6} x {N:<6} M={M:<5} " + "  ".join(f"{k.removesuffix('_ms')} {v:.4f}" for k, v in row.items()
                                                           if k.endswith("_ms"))
                  + (f"  best launch {best}" if "ms" in best else ""), flush=True)
        del awq, bf16
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M, comma-separated")
    ap.add_argument("--grid", action="store_true", help="also time the launch grid of each row count's path")
    ap.add_argument("--cold-mib", type=int, default=256, help="weight copies cycled per timed pass (0: one, hot)")
    from timing import parse_args

    args = parse_args(ap, argv, "tiny shapes on the CPU under TRITON_INTERPRET=1")
    if args is None:
        return 2
    from timing import smoke_iters

    if args.cpu_smoke:
        dev, shapes, rows, check_rows, dtypes = "cpu", [(256, 64)], [1, 2, 5, 40], [1, 2, 5, 40], [torch.float16]
        cold, grid = 0, 1
    else:
        dev, shapes, rows, check_rows = "cuda", SHAPES, [int(m) for m in args.rows.split(",")], CHECK_ROWS
        dtypes, cold, grid = [torch.bfloat16, torch.float16], args.cold_mib << 20, None if args.grid else 0
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke: the numbers mean nothing)",
                 "torch": torch.__version__, "cold_bytes": cold}
    res["check"] = check(dev, shapes, check_rows, dtypes)
    bad = [r for r in res["check"] if not r["ok"]]
    print(f"check: {len(res['check']) - len(bad)}/{len(res['check'])} ok" + "".join(f"\n  FAIL {r}" for r in bad))
    res["time"] = time_rows(dev, shapes, rows, dtypes[0], cold, grid, smoke_iters(args.cpu_smoke))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "w4a16.json").write_text(json.dumps(res, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
