"""RMSNorm, with the residual add fused in when a residual is passed (kernels: rms_norm, fused_add_rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

from vserve.kernels import for_device


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = for_device(x)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
