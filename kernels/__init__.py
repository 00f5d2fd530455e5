"""Kernels: each Triton kernel sits beside the pure-torch reference it must match (same signature).

`for_device(t)` picks the set for a tensor's device: Triton on CUDA, the references elsewhere (the CPU
path). Triton is imported only when a CUDA tensor asks for it.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

_NAMES = ("store_kvcache", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "fused_add_rms_norm",
          "silu_and_mul", "rotary_embedding", "fused_moe", "w4a16_gemm", "per_token_quant", "fp8_linear",
          "int8_linear", "fp8_mm", "int8_mm", "rms_norm_quant", "fused_add_rms_norm_quant", "silu_and_mul_quant",
          "sample_from_logits", "apply_token_bitmask", "lora_shrink", "lora_expand", "store_latent",
          "mla_decode_attention", "mla_prefill_attention", "rope_store_kvcache")


@cache
def _reference() -> SimpleNamespace:
    from vserve.kernels import lora_ref, mla_ref, moe_ref, ops_ref, paged_attention, sampling_ref, scaled_mm, w4a16_ref

    mods = (paged_attention, ops_ref, moe_ref, w4a16_ref, scaled_mm, sampling_ref, lora_ref, mla_ref)
    return SimpleNamespace(**{n: next(getattr(m, n + "_ref") for m in mods if hasattr(m, n + "_ref")) for n in _NAMES})


@cache
def _triton() -> SimpleNamespace:
    from vserve.kernels import (
        scaled_mm,
        triton_attention,
        triton_fused_moe,
        triton_lora,
        triton_mla,
        triton_ops,
        triton_sampling,
        triton_w4a16,
    )

    mods = (triton_attention, triton_ops, triton_fused_moe, triton_w4a16, scaled_mm, triton_sampling, triton_lora,
            triton_mla)
    return SimpleNamespace(**{n: next(getattr(m, n) for m in mods if hasattr(m, n)) for n in _NAMES})


def for_device(t) -> SimpleNamespace:
    return _triton() if t.is_cuda else _reference()
