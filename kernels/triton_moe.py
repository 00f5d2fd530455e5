"""Per-row Triton MoE: each program reads its token's expert id and multiplies by that expert's weights in
place, so tokens are never permuted or padded per expert (a GEMV per (token, slot) on CUDA cores). The grouped
tensor-core kernel (kernels/triton_fused_moe.py) serves MoE layers; it falls back to this one for batches of at most
`per_row_max_tokens` tokens (kernels/fused_moe_configs.json), where a GEMV may be faster.

Matches kernels/moe_ref.py:fused_moe_ref (same signature); accumulation in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, H, N, TOPK, stride_xt, stride_we, stride_wn, stride_ot,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t*k + s, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, N + n]), e = ids[t, s]."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(ids_ptr + row).to(tl.int64)
    tok = row // TOPK
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tok * stride_xt + k, mask=k < H, other=0.0).to(tl.float32)
        m = (n[:, None] < N) & (k[None, :] < H)
        wg = tl.load(w_ptr + e * stride_we + n[:, None] * stride_wn + k[None, :], mask=m, other=0.0)
        wu = tl.load(w_ptr + e * stride_we + (n[:, None] + N) * stride_wn + k[None, :], mask=m, other=0.0)
        gate += tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    dtype = out_ptr.dtype.element_ty
    act = (gate.to(dtype).to(tl.float32) / (1.0 + tl.exp(-gate.to(dtype).to(tl.float32)))).to(dtype)
    tl.store(out_ptr + row * stride_ot + n, (act.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype),
             mask=n < N)


@triton.jit
def _down_kernel(a_ptr, w_ptr, ids_ptr, tw_ptr, out_ptr, I, H, stride_at, stride_we, stride_wh, stride_ot,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t*k + s, h] = topk_weights[t, s] * (a[t*k + s] . w2[e, h])."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(ids_ptr + row).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + row * stride_at + k, mask=k < I, other=0.0).to(tl.float32)
        m = (h[:, None] < H) & (k[None, :] < I)
        w = tl.load(w_ptr + e * stride_we + h[:, None] * stride_wh + k[None, :], mask=m, other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32) * tl.load(tw_ptr + row).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + h, y.to(dtype), mask=h < H)


def fused_moe_per_row(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, block_n: int = 64, block_k: int = 64, num_warps: int = 4) -> torch.Tensor:
    """As fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, k] -> [T, H]."""
    T, H = x.shape
    k, I = topk_ids.shape[1], w2.shape[2]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids, tw = topk_ids.reshape(-1).contiguous(), topk_weights.reshape(-1).contiguous()
    act = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    bn, bk = min(block_n, triton.next_power_of_2(I)), min(block_k, triton.next_power_of_2(H))
    _gate_up_kernel[(T * k, triton.cdiv(I, bn))](x, w13, ids, act, H, I, k, x.stride(0), w13.stride(0),
                                                 w13.stride(1), act.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                                 num_warps=num_warps)
    out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    bn, bk = min(block_n, triton.next_power_of_2(H)), min(block_k, triton.next_power_of_2(I))
    _down_kernel[(T * k, triton.cdiv(H, bn))](act, w2, ids, tw, out, I, H, act.stride(0), w2.stride(0),
                                              w2.stride(1), out.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                              num_warps=num_warps)
    return out.view(T, k, H).sum(dim=1)
