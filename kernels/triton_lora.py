"""Batched multi-LoRA Triton kernels (vLLM's lora_shrink / lora_expand, formerly punica's SGMV/BGMV): the rows of a
step grouped by adapter slot (LoRAMapping, built once per step on the device), one program per (row tile: up to
BLOCK_M rows of one slot, output tile); the tiles are numbered on the device, their count depends on the row and
slot counts only (tiles past the last return at once), so a decode step is capturable in a CUDA graph. The row and
slot counts are not specialized on (`do_not_specialize`): vLLM's 10x TTFT problem was Triton recompiling per context
length. References and argument layout: lora_ref.py."""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from vserve.kernels.lora_ref import TILE_M, LoRAMapping

BLOCK_M = TILE_M


@triton.jit(do_not_specialize=["T", "S"])
def _shrink_kernel(x_ptr, a_ptr, out_ptr, order_ptr, starts_ptr, counts_ptr, tile_slot_ptr, tile_row_ptr, T, K, RT,
                   K_PER, S, stride_xt, stride_as, stride_ar, stride_ot, stride_os,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_r, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # split-K: a share of the features
    s = tl.load(tile_slot_ptr + pid_m)
    if s >= S:
        return
    count = tl.load(counts_ptr + s + 1)
    start = tl.load(starts_ptr + s + 1)
    offs_m = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < RT
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + s.to(tl.int64) * stride_as
    k_end = tl.minimum(K, (split + 1) * K_PER)
    for k0 in range(split * K_PER, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None], mask=mask_r[None, :] & mask_k[:, None],
                     other=0.0)
        acc += tl.dot(xt, at)
    tl.store(out_ptr + split * stride_os + rows[:, None].to(tl.int64) * stride_ot + offs_r[None, :], acc,
             mask=mask_m[:, None] & mask_r[None, :])


@triton.jit(do_not_specialize=["T", "S", "SPLITS"])
def _expand_kernel(buf_ptr, b_ptr, out_ptr, order_ptr, starts_ptr, counts_ptr, tile_slot_ptr, tile_row_ptr,
                   bounds_ptr, T, R, S, SPLITS, stride_bsp, stride_bt, stride_bs, stride_bn, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_m, pid_n, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # j: the packed slice
    s = tl.load(tile_slot_ptr + pid_m)
    if s >= S:
        return
    lo, hi = tl.load(bounds_ptr + j), tl.load(bounds_ptr + j + 1)
    n0 = lo + pid_n * BLOCK_N
    if n0 >= hi:
        return
    count = tl.load(counts_ptr + s + 1)
    start = tl.load(starts_ptr + s + 1)
    offs_m = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    bw = tl.load(b_ptr + s.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                 mask=mask_n[None, :] & mask_r[:, None], other=0.0)  # [R, N]
    bt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # [M, R]: the shrink's split-K partials added up here
    for sp in range(0, SPLITS):
        bt += tl.load(buf_ptr + sp * stride_bsp + rows[:, None] * stride_bt + j * R + offs_r[None, :],
                      mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    acc = tl.dot(bt.to(bw.dtype), bw)
    o_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    cur = tl.load(o_ptrs, mask=mask, other=0.0)
    tl.store(o_ptrs, (cur.to(tl.float32) + acc).to(cur.dtype), mask=mask)


def shrink_split_k(T: int, K: int) -> int:
    """Splits of the input features for the shrink: a decode step has few row blocks, each a long dot over K
    (14336 for an 8B down_proj), so K is split until about 64 row blocks x splits run; prefill steps do not split."""
    return max(1, min(K // 512, 64 // triton.cdiv(T, BLOCK_M)))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, m: LoRAMapping, split_k: int | None = None,
                partial: bool = False) -> torch.Tensor:
    """[T, L*R] float32 (lora_shrink_ref); partial: the split-K partial sums [splits, T, L*R] as they are, for
    lora_expand to add up as it reads them (one launch less a projection: at batch 1 a third of LoRA's launches)."""
    T, K = x.shape
    S, RT, _ = lora_a.shape
    assert x.stride(1) == 1 and lora_a.stride(2) == 1
    block_k = 64
    split = split_k or shrink_split_k(T, K)
    k_per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    split = triton.cdiv(K, k_per)
    # rows without adapter: never read. Split partials are summed after (here or by lora_expand), in order:
    # deterministic, unlike atomics.
    out = torch.empty(split, T, RT, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(RT))
    grid = (m.tile_slot.shape[0], triton.cdiv(RT, block_r), split)
    _shrink_kernel[grid](x, lora_a, out, m.token_order, m.slot_starts, m.slot_counts, m.tile_slot, m.tile_row, T, K,
                         RT, k_per, S, x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(1), out.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k)
    return out if partial else out[0] if split == 1 else out.sum(0)


@cache
def _bounds_tensor(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.int32, device=device)  # made once per layer shape, before any capture


def lora_expand(buf: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, m: LoRAMapping,
                bounds: tuple[int, ...]) -> None:
    """lora_expand_ref: buf [T, L*R] or the shrink's partial sums [splits, T, L*R]."""
    parts = buf if buf.dim() == 3 else buf.unsqueeze(0)
    T = parts.shape[1]
    S, _, R = lora_b.shape
    assert out.stride(1) == 1 and lora_b.stride(2) == 1 and parts.stride(2) == 1
    L = len(bounds) - 1
    widest = max(b - a for a, b in zip(bounds, bounds[1:]))
    block_n = 64
    grid = (m.tile_slot.shape[0], triton.cdiv(widest, block_n), L)
    _expand_kernel[grid](parts, lora_b, out, m.token_order, m.slot_starts, m.slot_counts, m.tile_slot, m.tile_row,
                         _bounds_tensor(tuple(bounds), out.device), T, R, S, parts.shape[0],
                         parts.stride(0), parts.stride(1), lora_b.stride(0), lora_b.stride(1), out.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(R)))
