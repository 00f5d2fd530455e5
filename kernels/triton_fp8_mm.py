"""FP8 W8A8 GEMM in Triton with split-K, for the decode shapes where cuBLASLt's FP8 kernels leave SMs idle.

At a few hundred rows, torch._scaled_mm runs every Llama-3-8B linear with 128 x 128 tiles (one kernel for all four
shapes on the H200): the N = 4096 outputs (o_proj, down_proj) are 2 x 32 = 64 tiles on 132 SMs, and down_proj's
K = 14336 makes each of them long. Here the K dimension is also split over programs; the last program of each
output tile to finish (an atomic arrival count) sums the fp32 partials in split order (deterministic) and applies
the per-token and per-channel scales. Semantics of kernels/scaled_mm.fp8_mm_ref (products exact, scaled in fp32,
rounded to the output dtype), except that on sm_90 the tensor cores' FP8 accumulation is not a full fp32 sum (as
cuBLAS's fast accumulation, which the engine's bf16 FP8 GEMMs use): on an H200 the error against the fp32 sum was
0.44-0.63% of the output's largest value, 0.96-1.02% with one split at K = 14336 (docs/performance.md;
benchmarks/kernels/w8a8.py checks each launch against the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vserve.kernels.triton_ops import arrival_counts


@triton.jit(do_not_specialize=["M"])  # the row count changes from step to step: no variant per "M % 16 == 0"
def _fp8_mm_kernel(a_ptr, b_ptr, as_ptr, bs_ptr, part_ptr, out_ptr, count_ptr, M, N, K_SPLIT, stride_am, stride_bn,
                   stride_om, stride_ps, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SWAP: tl.constexpr):
    """Program (n tile, m tile, k split): a [BLOCK_M, BLOCK_N] tile over K_SPLIT columns of K (a multiple of
    BLOCK_K). a [M, K] and b [N, K] e4m3, both K-contiguous (the operand order the FP8 tensor-core dot wants).
    SWAP: the tile is computed transposed, b's [BLOCK_N, BLOCK_K] times a's rows transposed, so that the weight rows
    fill the tensor-core instruction's 64-row side and a few dozen tokens its narrow side (BLOCK_M down to 16),
    instead of padding the tokens to 64 rows (the small-M FP8 kernels of CUTLASS swap A and B alike)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    k0 = pid_k.to(tl.int64) * K_SPLIT
    a_ptrs = a_ptr + k0 + rm[:, None].to(tl.int64) * stride_am + rk[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + k0 + rn[:, None].to(tl.int64) * stride_bn + rk[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=nmask[:, None], other=0.0)
        acc = tl.dot(b, tl.trans(a), acc) if SWAP else tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)
    xs = tl.load(as_ptr + rm, mask=mmask, other=0.0)
    ws = tl.load(bs_ptr + rn, mask=nmask, other=0.0)
    o_blk = tl.make_block_ptr(out_ptr, (M, N), (stride_om, 1), (pid_m * BLOCK_M, pid_n * BLOCK_N), (BLOCK_M, BLOCK_N),
                              (1, 0))
    if SPLIT == 1:
        tl.store(o_blk, (acc * xs[:, None] * ws[None, :]).to(out_ptr.dtype.element_ty), boundary_check=(0, 1))
    else:
        p_blk = tl.make_block_ptr(part_ptr + pid_k * stride_ps, (M, N), (N, 1), (pid_m * BLOCK_M, pid_n * BLOCK_N),
                                  (BLOCK_M, BLOCK_N), (1, 0))
        tl.store(p_blk, acc, boundary_check=(0, 1))
        tl.debug_barrier()  # every thread's partial is stored before the count
        count = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:  # the last split: sum in order
            tot = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLIT):
                s_blk = tl.make_block_ptr(part_ptr + s * stride_ps, (M, N), (N, 1),
                                          (pid_m * BLOCK_M, pid_n * BLOCK_N), (BLOCK_M, BLOCK_N), (1, 0))
                tot += tl.load(s_blk, boundary_check=(0, 1), padding_option="zero", cache_modifier=".cg")
            tl.store(o_blk, (tot * xs[:, None] * ws[None, :]).to(out_ptr.dtype.element_ty), boundary_check=(0, 1))
            tl.atomic_xchg(count, 0)  # ready for the next launch (CUDA-graph replays included)


def fp8_mm_splitk(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  out_dtype: torch.dtype, *, block_m: int = 128, block_n: int = 128, block_k: int = 128,
                  split_k: int = 1, num_warps: int = 8, num_stages: int = 4, swap: bool = False) -> torch.Tensor:
    """As scaled_mm.fp8_mm_ref: xq e4m3 [M, K] with x_scale fp32 [M, 1], weight e4m3 [N, K] with weight_scale fp32
    [N, 1] -> [M, N] in out_dtype. K must be a multiple of split_k * block_k. swap: each tile computed transposed
    (weight rows on the dot's wide side; for block_m < 64)."""
    M, K = xq.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and K % (split_k * block_k) == 0, (xq.shape, weight.shape, split_k, block_k)
    assert xq.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split_k)
    counts = arrival_counts(xq.device, grid[0] * grid[1]) if split_k > 1 else None
    if split_k > 1 and counts is None:  # no counts to be had (first use inside a CUDA-graph capture): one split
        split_k, grid = 1, grid[:2] + (1,)
    part = torch.empty(split_k, M, N, dtype=torch.float32, device=xq.device) if split_k > 1 else out
    _fp8_mm_kernel[grid](xq, weight, x_scale.reshape(-1), weight_scale.reshape(-1), part, out,
                         counts if counts is not None else out, M, N, K // split_k, xq.stride(0), weight.stride(0),
                         out.stride(0), M * N, SPLIT=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         SWAP=swap, num_warps=num_warps, num_stages=num_stages)
    return out
