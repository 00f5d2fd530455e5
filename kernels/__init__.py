"""Kernels: each Triton kernel sits beside the pure-torch reference it must match (same signature).

`for_device(t)` picks the set for a tensor's device: Triton on CUDA, the references elsewhere (the CPU
path). Triton is imported only when a CUDA tensor asks for it.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

_NAMES = ("store_kvcache", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "fused_add_rms_norm",
          "silu_and_mul", "rotary_embedding")


@cache
def _reference() -> SimpleNamespace:
    from vserve.kernels import ops_ref, paged_attention

    return SimpleNamespace(**{n: getattr(paged_attention, n + "_ref", None) or getattr(ops_ref, n + "_ref")
                              for n in _NAMES})


@cache
def _triton() -> SimpleNamespace:
    from vserve.kernels import triton_attention, triton_ops

    return SimpleNamespace(**{n: getattr(triton_attention, n, None) or getattr(triton_ops, n) for n in _NAMES})


def for_device(t) -> SimpleNamespace:
    return _triton() if t.is_cuda else _reference()
