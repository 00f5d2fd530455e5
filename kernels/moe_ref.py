"""Pure-torch references for the fused MoE (the CPU path and the oracle for kernels/triton_fused_moe.py and
kernels/triton_moe.py): the MoE layer itself and the expert sort it starts with."""

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


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_size: int,
                             num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) rows grouped by expert, each expert's group padded to a multiple of block_size:
    sorted_ids [T*k + E*(block_size - 1), rounded up to a block] holds flat row indices t*k + s (padding and the
    unused tail: T*k), expert_ids [len(sorted_ids) / block_size] the expert of each block (unused blocks: -1), and
    num_tokens_post_padded [1] the used length. Rows of one expert keep their order; experts without rows get no
    block."""
    flat = topk_ids.reshape(-1).tolist()
    n = len(flat)
    num_blocks = -(-(n + num_experts * (block_size - 1)) // block_size)
    sorted_ids, expert_ids = [n] * (num_blocks * block_size), [-1] * num_blocks
    pos = 0
    for e in range(num_experts):
        rows = [i for i, x in enumerate(flat) if x == e]
        padded = -(-len(rows) // block_size) * block_size
        sorted_ids[pos:pos + len(rows)] = rows
        expert_ids[pos // block_size:(pos + padded) // block_size] = [e] * (padded // block_size)
        pos += padded
    dev = topk_ids.device
    return (torch.tensor(sorted_ids, dtype=torch.int32, device=dev),
            torch.tensor(expert_ids, dtype=torch.int32, device=dev), torch.tensor([pos], dtype=torch.int32, device=dev))
