"""Norms. RMSNorm (Llama): the residual add fused in when a residual is passed (kernels: rms_norm,
fused_add_rms_norm), and the output quantized per token for a W8A8 linear when asked (rms_norm_quant,
fused_add_rms_norm_quant). Gemma's RMSNorm (x (1 + w)) and LayerNorm (with or without bias) in torch."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vserve.core.layers.quantization import QuantizedActivation
from vserve.kernels import for_device


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant_dtype: torch.dtype | None = None):
        """rms_norm(x), or (rms_norm(x + residual), x + residual). quant_dtype (the next linear's
        input_quant_dtype): the normed rows come quantized per token, as a QuantizedActivation."""
        ops = for_device(x)
        if quant_dtype is None:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            xq, scale = ops.rms_norm_quant(x, self.weight, self.eps, quant_dtype)
            return QuantizedActivation(xq, scale, torch.promote_types(x.dtype, self.weight.dtype))
        (xq, scale), residual = ops.fused_add_rms_norm_quant(x, residual, self.weight, self.eps, quant_dtype)
        return QuantizedActivation(xq, scale, torch.promote_types(residual.dtype, self.weight.dtype)), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), all in fp32 and rounded once (the weight is stored zero-centred)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """gemma_rms_norm(x), or (gemma_rms_norm(x + residual), x + residual)."""
        h = x if residual is None else x + residual
        hf = h.float()
        y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(h.dtype)
        return y if residual is None else (y, h)


class LayerNorm(nn.Module):
    """LayerNorm in fp32 (mean subtracted), with a bias (StarCoder2) or without one (Command R). A weight of shape
    [heads, d] normalizes each head of a [T, heads, d] tensor with its own weights (Command R's q/k norm)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-5, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(shape), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """layer_norm(x), or (layer_norm(x + residual), x + residual)."""
        h = x if residual is None else x + residual
        if self.bias is not None:  # torch's LayerNorm, as StarCoder2's checkpoints were trained with
            y = F.layer_norm(h, self.weight.shape, self.weight, self.bias, self.eps)
        else:
            hf = h.float()
            c = hf - hf.mean(-1, keepdim=True)
            y = (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(h.dtype)
        return y if residual is None else (y, h)
