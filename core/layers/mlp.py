"""Feed-forward blocks: gated (down(act(gate) * up), gate and up packed in one column-parallel linear) and plain
(c_proj(act(c_fc(x))), StarCoder2)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vserve.core.layers.linear import Linear
from vserve.core.layers.quantization import QuantConfig, QuantizedActivation
from vserve.kernels import for_device

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)). SiLU runs the silu_and_mul kernel (fused with a W8A8 down's input quant)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", quant: QuantConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.act_name, self.act = act, activation(act)
        self.gate_up_proj = Linear(hidden_size, {0: intermediate_size, 1: intermediate_size}, parallel="column",
                                   quant_config=quant, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = Linear(intermediate_size, hidden_size, parallel="row", quant_config=quant,
                                prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.act_name == "silu":
            quant = self.down_proj.input_quant_dtype
            ops = for_device(h)
            if quant is None:
                return self.down_proj(ops.silu_and_mul(h))
            return self.down_proj(QuantizedActivation(*ops.silu_and_mul_quant(h, quant), h.dtype))  # W8A8: fused
        gate, up = h.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)  # a W8A8 down quantizes its input itself


class MLP(nn.Module):
    """c_proj(act(c_fc(x))), with biases where the checkpoint has them."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool,
                 quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.act = activation(act)
        self.c_fc = Linear(hidden_size, intermediate_size, bias=bias, parallel="column", quant_config=quant,
                           prefix=f"{prefix}.c_fc")
        self.c_proj = Linear(intermediate_size, hidden_size, bias=bias, parallel="row", quant_config=quant,
                             prefix=f"{prefix}.c_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))
