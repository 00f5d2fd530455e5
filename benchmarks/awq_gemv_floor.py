"""What bounds the AWQ batch-1 GEMV on the H200 (issue #7): the same loads without the arithmetic.

    python benchmarks/awq_gemv_floor.py --out $OUT     # ~4 min on the H200

For each of Llama-3-8B's four linear shapes, timed cold (cycling through >= 256 MiB of weight copies, so that no
call finds its weight in L2, as in a decode step) in CUDA graphs:
- copy: torch's device-to-device copy of the 4-bit codes (the memory ceiling for those bytes);
- bf16: F.linear on a bf16 weight of the shape (what the AWQ GEMV is compared with);
- awq: triton_w4a16's AWQ GEMV with its default launch;
- floor: a kernel with the GEMV's grid and tiles ([WK, BLOCK_K, BLOCK_W] words a K-tile, one program per column
  block and K-split) that loads the same words and only XORs them: how fast this decomposition can read the codes.
  Prefetch 0 lets Triton pipeline the loop (num_stages), 1 is the GEMV's register double buffer, 2 loads two tiles
  ahead. Its launch grid is swept; the fastest per shape is kept.
If the floor is near the copy, the GEMV's arithmetic is what costs; if the floor is as slow as the GEMV, the way it
reads the codes is.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
COLD_BYTES = 256 << 20


@triton.jit
def _floor_kernel(qw_ptr, out_ptr, K, k_per_split, stride_qk, stride_osplit, BLOCK_W: tl.constexpr,
                  BLOCK_K: tl.constexpr, WK: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr):
    pid_w, pid_k = tl.program_id(0), tl.program_id(1)
    nw = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    rows = tl.arange(0, WK)[:, None] + tl.arange(0, BLOCK_K)[None, :] * WK
    TILE: tl.constexpr = BLOCK_K * WK
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((WK, BLOCK_W), dtype=tl.int32)
    if PREFETCH == 0:
        for k0 in tl.range(k_start, k_end, TILE, num_stages=STAGES):
            w = tl.load(qw_ptr + (k0 + rows)[:, :, None] * stride_qk + nw[None, None, :])
            acc ^= tl.xor_sum(w, axis=1)
    elif PREFETCH == 1:
        w = tl.load(qw_ptr + (k_start + rows)[:, :, None] * stride_qk + nw[None, None, :])
        for k0 in range(k_start, k_end, TILE):
            kn = tl.minimum(k0 + TILE + rows, k_end - 1)
            w_n = tl.load(qw_ptr + kn[:, :, None] * stride_qk + nw[None, None, :])
            acc ^= tl.xor_sum(w, axis=1)
            w = w_n
    else:
        w = tl.load(qw_ptr + (k_start + rows)[:, :, None] * stride_qk + nw[None, None, :])
        w1 = tl.load(qw_ptr + tl.minimum(k_start + TILE + rows, k_end - 1)[:, :, None] * stride_qk
                     + nw[None, None, :])
        for k0 in range(k_start, k_end, TILE):
            kn = tl.minimum(k0 + 2 * TILE + rows, k_end - 1)
            w2 = tl.load(qw_ptr + kn[:, :, None] * stride_qk + nw[None, None, :])
            acc ^= tl.xor_sum(w, axis=1)
            w = w1
            w1 = w2
    tl.store(out_ptr + pid_k * stride_osplit + nw, tl.xor_sum(acc, axis=0))


def floor(qw: torch.Tensor, out: torch.Tensor, cfg: dict) -> None:
    K, W = qw.shape
    bw, bk, wk, split = cfg["block_n"] // 8, cfg["block_k"], cfg["num_warps"], cfg["split_k"]
    kps = K // split
    _floor_kernel[(W // bw, split)](qw, out, K, kps, qw.stride(0), out.stride(0), BLOCK_W=bw, BLOCK_K=bk, WK=wk,
                                    PREFETCH=cfg["prefetch"], STAGES=cfg["stages"], num_warps=wk, num_stages=1)


GRID = [dict(block_n=bn, block_k=bk, num_warps=w, split_k=s, prefetch=p, stages=st)
        for bn, bk, w, s, (p, st) in itertools.product((512, 1024), (8, 16), (2, 4, 8), (8, 16, 32, 64),
                                                       ((0, 1), (0, 3), (0, 4), (1, 1), (2, 1)))
        if bn * bk <= 16384]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    from h200_quant import w4_weight

    from vserve.kernels import triton_w4a16
    from vserve.kernels.gpu_check import time_ms

    dev = "cuda"
    rows = []
    for K, N in SHAPES:
        reps = max(1, -(-COLD_BYTES // (K * N // 2)))
        copies = [w4_weight("awq", K, N, dev)[:3] for _ in range(reps)]
        dsts = [torch.empty_like(c[0]) for c in copies]
        wreps = max(1, -(-COLD_BYTES // (K * N * 2)))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(wreps)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        code_bytes = K * N / 2

        def each(f, n):
            return time_ms(f, dev, iters=4)[0] / n

        row = dict(K=K, N=N)
        row["copy_ms"] = each(lambda _d=dsts, _c=copies: [d.copy_(c[0]) for d, c in zip(_d, _c)], reps)
        row["bf16_ms"] = each(lambda _w=ws, _x=x: [torch.nn.functional.linear(_x, w) for w in _w], wreps)
        row["awq_ms"] = each(lambda _c=copies, _x=x: [triton_w4a16.w4a16_gemm(_x, *c, None, "awq", 4, 128)
                                                      for c in _c], reps)
        out = torch.empty(128, N // 8, dtype=torch.int32, device=dev)
        timed = []
        for cfg in GRID:
            if K % (cfg["split_k"] * cfg["block_k"] * cfg["num_warps"]) or (N // 8) % (cfg["block_n"] // 8):
                continue
            try:
                timed.append((each(lambda c=cfg, _c=copies, _o=out: [floor(q[0], _o, c) for q in _c], reps), cfg))
            except Exception as e:  # out of resources
                print(f"{K}x{N} {cfg}: {e!r}"[:200], flush=True)
        timed.sort(key=lambda t: t[0])
        row["floor_best"] = [dict(ms=t, **c) for t, c in timed[:8]]
        for p, st in ((0, 1), (0, 3), (0, 4), (1, 1), (2, 1)):
            mine = [t for t in timed if t[1]["prefetch"] == p and t[1]["stages"] == st]
            if mine:
                row[f"floor_p{p}s{st}_ms"] = mine[0][0]
                row[f"floor_p{p}s{st}_cfg"] = mine[0][1]
        for k in ("copy", "awq"):
            row[f"{k}_TBps"] = code_bytes / (row[f"{k}_ms"] * 1e-3) / 1e12
        row["floor_TBps"] = code_bytes / (timed[0][0] * 1e-3) / 1e12 if timed else None
        row["bf16_TBps"] = K * N * 2 / (row["bf16_ms"] * 1e-3) / 1e12
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_cfg") and k != "floor_best"}), flush=True)
        print("  best floor:", row["floor_best"][:3], flush=True)
        del copies, dsts, ws
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "awq_gemv_floor.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
