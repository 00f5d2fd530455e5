"""The decoder layers of a Llama-like HF model (Llama, Mistral, Qwen2, Qwen3) as quantization sees them: groups
of linears that share an input, each with the module before it that a per-input-channel scale folds into."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True, slots=True)
class Group:
    prev: str | None  # the module whose output is the group's input; None: nothing to fold a scale into
    linears: tuple[str, ...]
    block: str | None  # the module whose output AWQ's scale search compares (AutoAWQ's module2inspect)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """("model.layers", the layers) of a Llama-like causal LM; ValueError for any other architecture."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    names = LINEARS + NORMS
    ok = isinstance(layers, nn.ModuleList) and len(layers) > 0 and all(
        _has(layer, n) for layer in layers for n in names)
    if not ok or any(not isinstance(layers[0].get_submodule(n), nn.Linear) for n in LINEARS):
        raise ValueError(f"vserve quantize supports Llama-like models (q/k/v/o and gate/up/down projections: Llama, "
                         f"Mistral, Qwen2, Qwen3), got model_type {getattr(model.config, 'model_type', '?')!r}")
    return "model.layers", layers


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def layer_groups(layer: nn.Module, method: str) -> list[Group]:
    """AutoAWQ's groups for Llama: norm -> q,k,v; v -> o when v and o have the same shape (no GQA; otherwise o
    has nothing to fold into); norm -> gate,up; up -> down. SmoothQuant (int8) never smooths o, as llm-compressor."""
    v, o = layer.self_attn.v_proj, layer.self_attn.o_proj
    v_to_o = method == "awq" and v.weight.shape == o.weight.shape
    return [
        Group("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        Group("self_attn.v_proj" if v_to_o else None, ("self_attn.o_proj",), None),
        Group("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        Group("mlp.up_proj", ("mlp.down_proj",), None),
    ]


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Divide prev's output channels by s and multiply the linears' input channels by s: the float function of
    prev followed by the linears is unchanged. prev is an RMSNorm (y = weight * x_hat) or a linear."""
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:
        assert prev.weight.shape == s.shape, (type(prev).__name__, tuple(prev.weight.shape), tuple(s.shape))
        prev.weight.div_(s.to(prev.weight.dtype))
    for lin in linears:
        lin.weight.mul_(s[None, :].to(lin.weight.dtype))
