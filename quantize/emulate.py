"""Read a quantized folder (AWQ GEMM, GPTQ, compressed-tensors FP8/INT8) back into a float HF transformers model
that computes what the quantized model computes: every quantized weight dequantized from its stored tensors, and,
for W8A8 schemes, every quantized linear's input quantized per token first. For perplexity, not for speed."""

from __future__ import annotations

from pathlib import Path

import torch

from vserve.quantize.checkpoint import quantization_config_of
from vserve.quantize.formats import dequantize_awq, dequantize_gptq
from vserve.quantize.w8a8 import dequantize_weight, fake_quantize_activation, unpack_int8


def dequantized_weights(tensors: dict[str, torch.Tensor], qc: dict) -> tuple[dict[str, torch.Tensor], str | None]:
    """({linear prefix: float32 W [out, in]}, activation kind "fp8" | "int8" | None) from the stored tensors."""
    method = qc["quant_method"]
    weights, act = {}, None
    if method == "awq":
        for name in tensors:
            if name.endswith(".qweight"):
                p = name.removesuffix(".qweight")
                weights[p] = dequantize_awq(tensors[name], tensors[p + ".qzeros"], tensors[p + ".scales"],
                                            qc["group_size"])
    elif method == "gptq":
        for name in tensors:
            if name.endswith(".qweight"):
                p = name.removesuffix(".qweight")
                weights[p] = dequantize_gptq(tensors[name], tensors[p + ".qzeros"], tensors[p + ".scales"],
                                             tensors[p + ".g_idx"], qc["bits"])
    elif method == "compressed-tensors":
        group = qc["config_groups"]["group_0"]
        if group.get("input_activations"):
            act = "fp8" if group["input_activations"]["type"] == "float" else "int8"
        for name in tensors:
            if name.endswith(".weight_scale"):
                p = name.removesuffix(".weight_scale")
                q = tensors[p + ".weight"] if p + ".weight" in tensors else unpack_int8(tensors[p + ".weight_packed"])
                weights[p] = dequantize_weight(q, tensors[name])
    else:
        raise ValueError(f"unknown quant_method {method!r} in {qc}")
    return weights, act


def load_fake_quantized(folder: Path, dtype: torch.dtype = torch.float32):
    """An HF model of the folder's architecture holding the dequantized weights (see the module docstring)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    qc = quantization_config_of(folder)
    if qc is None:
        raise ValueError(f"{folder} has no quantization_config in config.json")
    cfg = AutoConfig.from_pretrained(folder)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # transformers would hand the model to AutoAWQ / GPTQModel / compressed-tensors
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    weights, act = dequantized_weights(tensors, qc)
    suffixes = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_packed", ".weight_shape")
    state = {k: v.to(dtype) for k, v in tensors.items()
             if not (k.endswith(suffixes) or (k.endswith(".weight") and k.removesuffix(".weight") in weights))}
    state.update({p + ".weight": w.to(dtype) for p, w in weights.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{folder}: missing {missing[:3]}, unexpected {unexpected[:3]} tensors")
    model.tie_weights()
    if act is not None:
        for p in weights:
            model.get_submodule(p).register_forward_pre_hook(
                lambda _m, args, kind=act: (fake_quantize_activation(args[0], kind), *args[1:]))
    return model
