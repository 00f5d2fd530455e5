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


FP8_MAX = 448.0  # largest float8_e4m3fn
INT8_MAX = 127.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor: an all-zero row still gets a finite, nonzero scale


def per_token_quant_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric quantization per row of x [M, K] to float8_e4m3fn or int8 -> (xq [M, K], scale [M, 1]
    float32) with x ~ xq * scale: scale = max|row| / qmax (at least MIN_SCALE); fp8 saturates, int8 rounds half
    to even and clamps to [-128, 127]."""
    xf = x.float()
    qmax = FP8_MAX if dtype == torch.float8_e4m3fn else INT8_MAX
    amax = xf.abs().amax(-1, keepdim=True)
    # a tensor divisor: CUDA torch turns division by a Python scalar into a multiply by its reciprocal
    scale = torch.clamp(amax / torch.full_like(amax, qmax), min=MIN_SCALE)
    v = xf / scale
    if dtype == torch.float8_e4m3fn:
        return v.clamp(-FP8_MAX, FP8_MAX).to(dtype), scale
    assert dtype == torch.int8, dtype
    return torch.round(v).clamp(-128, 127).to(torch.int8), scale


# Each W8A8 linear's input quantized by the kernel that produces it (one launch instead of two): the same values
# as producing the activation in its dtype and then quantizing it.


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_quant_ref(rms_norm_ref(x, weight, eps), dtype) -> (xq [..., K], scale [..., 1])."""
    return per_token_quant_ref(rms_norm_ref(x, weight, eps), dtype)


def fused_add_rms_norm_quant_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                 dtype: torch.dtype) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((xq, scale) of rms_norm(x + residual), x + residual)."""
    normed, h = fused_add_rms_norm_ref(x, residual, weight, eps)
    return per_token_quant_ref(normed, dtype), h


def silu_and_mul_quant_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_quant_ref(silu_and_mul_ref(x), dtype): x [..., 2N] -> (xq [..., N], scale [..., 1])."""
    return per_token_quant_ref(silu_and_mul_ref(x), dtype)
