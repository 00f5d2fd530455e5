"""Pure-torch references for the non-attention kernels (the CPU path and the oracle for kernels/triton_ops.py).

Each returns new tensors and leaves its inputs untouched; the rounding points follow the model layers
(core/layers/norm.py, rotary.py, the MLP's ``F.silu(gate) * up``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, cast back to x's dtype, then scaled by weight (HF Llama's order)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the normed hidden state and the new residual stream."""
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE: q [T, H, d], k [T, kvh, d], cos/sin [max_pos, d/2] (fp32) -> rotated copies."""
    c, s = cos[positions].unsqueeze(1).float(), sin[positions].unsqueeze(1).float()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
