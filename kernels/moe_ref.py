"""Pure-torch reference for the fused MoE (the CPU path and the oracle for kernels/triton_moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] = [gate | up], w2 [E, H, I], topk_weights/ids [T, k] -> [T, H]:
    sum over k of weight * down(silu(gate(x)) * up(x)) with expert topk_ids[t, k] (HF Mixtral's order)."""
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        tok, slot = torch.where(topk_ids == e)
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out
