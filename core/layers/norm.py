"""RMSNorm, with the residual add fused in when a residual is passed (kernels: rms_norm, fused_add_rms_norm), and
the output quantized per token for a W8A8 linear when asked (rms_norm_quant, fused_add_rms_norm_quant)."""

from __future__ import annotations

import torch
from torch import nn

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
