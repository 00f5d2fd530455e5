"""Triton sampling kernel: one inverse-CDF draw per row straight from the processed logits, in one launch.

Replaces softmax + cumsum + searchsorted (three launches and several full passes over [B, V]) by one program per
row. Pass 1 reads the row in BLOCK-sized chunks keeping a per-lane online max and sum of exp(x - max), so the loop
has no cross-lane reduction; pass 2 walks the chunks again with a running sum (tl.cumsum within a chunk) and stops
in the chunk whose prefix reaches (1 - u) * sum, so it reads half the row on average. Matches
sample_from_logits_ref (kernels/sampling_ref.py) token for token, up to float summation order at an exact CDF
boundary; the zero-mass rule (never a token with probability 0) is the reference's. Math is fp32; logits
fp32/fp16/bf16 with a unit stride along the vocabulary. Nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(logits_ptr, u_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * stride
    offs = tl.arange(0, BLOCK)

    # pass 1: per lane, the max and the sum of exp(x - max) over the lane's columns
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane without a finite logit yet keeps s = 0
        s = s * tl.exp(m - ref) + tl.exp(x - ref)
        m = m_new
    row_max = tl.max(m, axis=0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row without mass: zeros below, not NaN
    total = tl.sum(s * tl.exp(m - row_max), axis=0)
    target = (1.0 - tl.load(u_ptr + row)) * total

    # pass 2, chunk by chunk until one holds the crossing: the first column whose inclusive prefix reaches the
    # target (V: none yet) and the last column with mass at or before it
    first = V
    running = 0.0
    last_nz = -1
    start = 0
    while (first == V) & (start < V):
        cols = start + offs
        p = tl.exp(tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) - row_max)
        prefix = running + tl.cumsum(p, axis=0)
        first = tl.min(tl.where((prefix >= target) & (cols < V), cols, V), axis=0)
        last_nz = tl.maximum(last_nz, tl.max(tl.where((p > 0) & (cols <= first), cols, -1), axis=0))
        running = tl.sum(tl.where(offs == BLOCK - 1, prefix, 0.0), axis=0)  # the chunk's last prefix, exactly
        start += BLOCK
    # The zero-mass rule: the last column with mass at or before the crossing (the whole row when rounding left
    # the target above every prefix); 0 for a row without mass.
    tok = tl.maximum(last_nz, 0)
    tl.store(out_ptr + row, tok.to(tl.int64))


def sample_from_logits(logits: torch.Tensor, u: torch.Tensor, *, block: int = 4096,
                       num_warps: int = 16) -> torch.Tensor:
    """As sample_from_logits_ref: logits [B, V] (masked entries -inf), u [B] uniform in [0, 1) -> tokens [B]
    int64, a new tensor. One program per row, reading `block` columns at a time."""
    B, V = logits.shape
    assert u.shape == (B,), (u.shape, B)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    _sample_kernel[(B,)](logits, u.float().contiguous(), out, V, logits.stride(0),
                         BLOCK=min(block, triton.next_power_of_2(V)), num_warps=num_warps)
    return out


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, V, W, stride, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    row = tl.load(rows_ptr + j).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(mask_ptr + j * W + cols // 32, mask=cols // 32 < W, other=0)
    banned = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride + cols, tl.full((BLOCK,), float("-inf"), tl.float32), mask=(cols < V) & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, *,
                        block: int = 1024) -> None:
    """apply_token_bitmask_ref (kernels/sampling_ref.py) in one launch over the constrained rows: a program per
    (row, BLOCK columns) reads its bitmask words and writes -inf where a token is not allowed."""
    assert logits.stride(1) == 1 and bitmask.is_contiguous()
    if rows.numel() == 0:
        return
    V, W = logits.shape[1], bitmask.shape[1]
    _bitmask_kernel[(rows.numel(), triton.cdiv(V, block))](logits, bitmask, rows, V, W, logits.stride(0),
                                                           BLOCK=block)
