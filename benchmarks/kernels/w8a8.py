"""The W8A8 GEMMs (kernels/scaled_mm.py, kernels/triton_fp8_mm.py) on Llama-3-8B's four linear shapes: checked against
their references, timed beside bf16 F.linear with the weights out of L2, and (--tune) the FP8 split-K table tuned.

    python benchmarks/kernels/w8a8.py --out $OUT                  # H200, a few minutes
    python benchmarks/kernels/w8a8.py --out $OUT --tune           # + scaled_mm.FP8_SPLITK tuned on this GPU, ~10 min
    python benchmarks/kernels/w8a8.py --cpu-smoke --out /tmp/w8a8 # tiny shapes, TRITON_INTERPRET=1

Check: the per-token quantizer (FP8 e4m3 and INT8) bit for bit against per_token_quant_ref; fp8_linear and int8_linear
against their references (FP8 within bf16's tolerance: the split-K kernel's dots accumulate as cuBLAS's fast
accumulation does); every split-K launch FP8_SPLITK holds, through fp8_mm_splitk, against fp8_mm_ref.
Time (ms per GEMM): bf16 F.linear; the quantizer alone; fp8_mm as the engine calls it (split-K where the table says),
cuBLAS alone (splitk_table={}), cuBLAS with exact accumulation (fast_accum=False); int8_mm.
--tune: for each shape and CUDA-graph batch size, cuBLAS against every launch of a grid (swapped tiles included),
cold; the launches that take under 0.97x cuBLAS's time become the table, printed in FP8_SPLITK's form to paste into
kernels/scaled_mm.py. Every variant is a keyword of fp8_mm / fp8_mm_splitk. JSON: OUT/w8a8.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N): qkv, o, gate_up, down of Llama-3-8B
ROWS = [1, 16, 64, 128, 256, 2048]
TUNE_ROWS = [16, 32, 48, 64, 96, 128, 160, 192, 224, 256]  # the CUDA-graph batch sizes up to 256
SWAP_MAX_M = 128  # swapped tiles (the weight rows on the dot's wide side) serve at most this many rows
TUNE_GRID = [dict(block_m=bm, block_n=bn, block_k=bk, split_k=sk, num_warps=w, num_stages=st, swap=False)
             for bm, bn, bk, w, st in ((64, 128, 128, 4, 4), (64, 64, 128, 4, 5), (128, 128, 128, 8, 4),
                                       (128, 64, 128, 4, 4), (64, 64, 256, 4, 4), (64, 128, 256, 4, 3))
             for sk in (1, 2, 4, 8)] + \
            [dict(block_m=bm, block_n=bn, block_k=bk, split_k=sk, num_warps=4, num_stages=st, swap=True)
             for bm, bn, bk, st in ((16, 64, 256, 4), (16, 64, 128, 8), (16, 128, 256, 3), (32, 64, 256, 4),
                                    (32, 64, 128, 6), (32, 128, 128, 4))
             for sk in (1, 2, 4, 8)]
MARGIN = 0.97  # a split-K launch is taken where it needs under this fraction of cuBLAS's time


def w8_weight(kind: str, K: int, N: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [N, K] weight quantized per output channel: (codes, scales [N, 1])."""
    from vserve.kernels.ops_ref import per_token_quant_ref

    return per_token_quant_ref(torch.randn(N, K, device=dev) * 0.02, torch.float8_e4m3fn if kind == "fp8"
                               else torch.int8)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)


def check(dev: str, shapes, rows, dtypes, launches) -> list[dict]:
    """launches(K, N): the split-K launches to check at that shape, as (most rows, launch) pairs."""
    from vserve.kernels import ops_ref, scaled_mm, triton_fp8_mm, triton_ops

    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}
    out = []
    for K, N in shapes:
        for kind, qdt in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
            w, ws = w8_weight(kind, K, N, dev)
            linear, ref_linear = (scaled_mm.fp8_linear, scaled_mm.fp8_linear_ref) if kind == "fp8" else \
                (scaled_mm.int8_linear, scaled_mm.int8_linear_ref)
            for dtype in dtypes:
                for M in rows:
                    x = torch.randn(M, K, device=dev).to(dtype)
                    q, qs = triton_ops.per_token_quant(x, qdt)
                    rq, rqs = ops_ref.per_token_quant_ref(x, qdt)
                    exact = bool(torch.equal(qs, rqs) and torch.equal(q.float(), rq.float()))
                    err = rel_err(linear(x, w, ws), ref_linear(x, w, ws))
                    limit = tol[torch.bfloat16] if kind == "fp8" else tol[dtype]
                    out.append(dict(kernel=f"{kind}_linear", K=K, N=N, M=M, dtype=str(dtype).removeprefix("torch."),
                                    rel_err=err, quant_exact=exact, ok=exact and err <= limit))
        w, ws = w8_weight("fp8", K, N, dev)
        for most, cfg in launches(K, N):
            xq, xs = triton_ops.per_token_quant(torch.randn(most, K, device=dev, dtype=torch.bfloat16),
                                                torch.float8_e4m3fn)
            err = rel_err(triton_fp8_mm.fp8_mm_splitk(xq, xs, w, ws, torch.bfloat16, **cfg),
                          scaled_mm.fp8_mm_ref(xq, xs, w, ws, torch.float32))
            out.append(dict(kernel="fp8_mm_splitk", K=K, N=N, M=most, dtype="bfloat16", launch=cfg, rel_err=err,
                            ok=err <= 2e-2))
    return out


def time_rows(dev: str, shapes, rows, cold_bytes: int, timing: dict) -> list[dict]:
    """ms per GEMM of each path at each shape and row count (weights cycled out of L2 unless cold_bytes is 0)."""
    from timing import copies, time_ms

    from vserve.kernels import scaled_mm, triton_ops

    out = []
    for K, N in shapes:
        fp8 = copies(lambda K=K, N=N: w8_weight("fp8", K, N, dev), K * N, cold_bytes)
        int8 = copies(lambda K=K, N=N: w8_weight("int8", K, N, dev), K * N, cold_bytes)
        bf16 = copies(lambda K=K, N=N: (torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02,), 2 * K * N,
                      cold_bytes)
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            xq, xs = triton_ops.per_token_quant(x, torch.float8_e4m3fn)
            iq, i_s = triton_ops.per_token_quant(x, torch.int8)
            mm = partial(scaled_mm.fp8_mm, xq, xs, out_dtype=torch.bfloat16)
            row = dict(K=K, N=N, M=M, bf16_ms=time_ms(partial(torch.nn.functional.linear, x), dev, bf16, **timing),
                       quant_ms=time_ms(partial(triton_ops.per_token_quant, x, torch.float8_e4m3fn), dev, **timing),
                       fp8_ms=time_ms(mm, dev, fp8, **timing),
                       fp8_cublas_ms=time_ms(partial(mm, splitk_table={}), dev, fp8, **timing),
                       fp8_cublas_exact_ms=time_ms(partial(mm, splitk_table={}, fast_accum=False), dev, fp8, **timing),
                       int8_ms=time_ms(partial(scaled_mm.int8_mm, iq, i_s, out_dtype=torch.bfloat16), dev, int8,
                                       **timing))
            row["fp8_vs_bf16"] = row["bf16_ms"] / row["fp8_ms"]
            out.append(row)
            print(f"{K:>6} x {N:<6} M={M:<5} " + "  ".join(f"{k.removesuffix('_ms')} {v:.4f}" for k, v in row.items()
                                                           if k.endswith("_ms")), flush=True)
        del fp8, int8, bf16
    return out


def tune(dev: str, shapes, rows, grid, cold_bytes: int, timing: dict,
         margin: float = MARGIN) -> tuple[list[dict], dict]:
    """For each shape and row count, cuBLAS against each launch of grid (bf16 outputs): the timed rows, and the table
    FP8_SPLITK takes: per shape ((most rows, the best launch where it needs under margin x cuBLAS's time, else None),
    ...), runs of one choice merged, cuBLAS entries past the last launch dropped."""
    from timing import copies, time_ms

    from vserve.kernels import scaled_mm, triton_fp8_mm, triton_ops

    out, table = [], {}
    for K, N in shapes:
        weights = copies(lambda K=K, N=N: w8_weight("fp8", K, N, dev), K * N, cold_bytes)
        entries: list[tuple[int, dict | None]] = []
        for M in rows:
            xq, xs = triton_ops.per_token_quant(torch.randn(M, K, device=dev, dtype=torch.bfloat16),
                                                torch.float8_e4m3fn)
            ref = scaled_mm.fp8_mm_ref(xq, xs, *weights[0], torch.float32)
            cublas = time_ms(partial(scaled_mm.fp8_mm, xq, xs, out_dtype=torch.bfloat16, splitk_table={}), dev,
                             weights, **timing)
            best = None
            for cfg in grid:
                if K % (cfg["split_k"] * cfg["block_k"]) or (cfg["swap"] and M > SWAP_MAX_M):
                    continue
                splitk = partial(triton_fp8_mm.fp8_mm_splitk, xq, xs, out_dtype=torch.bfloat16, **cfg)
                try:
                    err = rel_err(splitk(*weights[0]), ref)
                    ms = time_ms(splitk, dev, weights, **timing)
                except Exception as e:  # a launch that does not fit: keep the others
                    out.append(dict(K=K, N=N, M=M, launch=cfg, error=f"{type(e).__name__}: {str(e)[:120]}"))
                    continue
                out.append(dict(K=K, N=N, M=M, launch=cfg, ms=ms, cublas_ms=cublas, rel_err=err))
                if err < 2e-2 and (best is None or ms < best[0]):
                    best = (ms, cfg)
            choice = best[1] if best is not None and best[0] < margin * cublas else None
            if entries and entries[-1][1] == choice:
                entries.pop()  # the same choice as the row count below: one entry serves both
            entries.append((M, choice))
            print(f"tune {K} x {N} M={M}: cuBLAS {cublas:.4f} ms, best split-K "
                  + (f"{best[0]:.4f} ms {best[1]}" if best else "none") + (" (taken)" if choice else ""), flush=True)
        while entries and entries[-1][1] is None:  # past the last entry is cuBLAS anyway
            entries.pop()
        if entries:
            table[(K, N)] = tuple(entries)
        del weights
    return out, table


def table_source(table: dict) -> str:
    """The table as kernels/scaled_mm.py writes FP8_SPLITK (launches through its _L helper)."""
    def launch(c: dict | None) -> str:
        if c is None:
            return "None"
        extra = (f", {c['block_k']}" if c["block_k"] != 128 else "") + (", swap=True" if c["swap"] else "")
        return f"_L({c['block_m']}, {c['block_n']}, {c['split_k']}, {c['num_warps']}, {c['num_stages']}{extra})"

    lines = ["FP8_SPLITK: dict[tuple[int, int], tuple[tuple[int, dict | None], ...]] = {"]
    for (K, N), entries in table.items():
        lines.append(f"    ({K}, {N}): (" + ", ".join(f"({m}, {launch(c)})" for m, c in entries) + ",),")
    return "\n".join(lines + ["}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M timed, comma-separated")
    ap.add_argument("--tune", action="store_true", help="tune the FP8 split-K table (scaled_mm.FP8_SPLITK)")
    ap.add_argument("--cold-mib", type=int, default=256, help="weight copies cycled per timed pass (0: one, hot)")
    from timing import parse_args

    args = parse_args(ap, argv, "tiny shapes on the CPU under TRITON_INTERPRET=1")
    if args is None:
        return 2
    from timing import smoke_iters

    from vserve.kernels import scaled_mm

    if args.cpu_smoke:  # the tiny shape is in no table: two launches of the grid stand for it
        dev, shapes, rows, tune_rows, cold = "cpu", [(256, 64)], [1, 16], [16], 0
        grid = TUNE_GRID[4:5] + TUNE_GRID[-4:-3]
        dtypes = [torch.float16]

        def launches(K, N):
            return [(16, cfg) for cfg in grid]
    else:
        dev, shapes, tune_rows, grid = "cuda", SHAPES, TUNE_ROWS, TUNE_GRID
        rows = [int(m) for m in args.rows.split(",")]
        dtypes, cold = [torch.bfloat16, torch.float16], args.cold_mib << 20

        def launches(K, N):
            return [(most, cfg) for most, cfg in scaled_mm.FP8_SPLITK.get((K, N), ()) if cfg is not None]
    timing = smoke_iters(args.cpu_smoke)
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke: the numbers mean nothing)",
                 "torch": torch.__version__, "cold_bytes": cold}
    res["check"] = check(dev, shapes, [m for m in rows if m <= 256], dtypes, launches)
    bad = [r for r in res["check"] if not r["ok"]]
    print(f"check: {len(res['check']) - len(bad)}/{len(res['check'])} ok" + "".join(f"\n  FAIL {r}" for r in bad))
    res["time"] = time_rows(dev, shapes, rows, cold, timing)
    if args.tune:
        # the smoke takes the best launch whatever its time, so that its table has an entry
        res["tune"], table = tune(dev, shapes, tune_rows, grid, cold, timing if args.cpu_smoke else
                                  dict(iters=2, repeats=3), float("inf") if args.cpu_smoke else MARGIN)
        res["table"] = {f"{K}x{N}": entries for (K, N), entries in table.items()}
        print(table_source(table))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "w8a8.json").write_text(json.dumps(res, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
