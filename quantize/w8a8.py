"""8-bit weights per output channel (FP8 e4m3 or INT8, symmetric) and dynamic per-token 8-bit activations:
compressed-tensors' FP8_DYNAMIC and W8A8 schemes, as llm-compressor writes them and vLLM runs them."""

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
INT8_MAX = 127
_MIN_SCALE = 1.0 / (FP8_MAX * 512)  # vLLM's floor for a dynamic per-token scale (an all-zero token)
KINDS = ("fp8", "int8")


def quantize_weight(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q [out, in] float8_e4m3fn or int8, scale float32 [out, 1]), W ~= q * scale."""
    assert kind in KINDS, kind
    w = w.float()
    top = FP8_MAX if kind == "fp8" else INT8_MAX
    scale = (w.abs().amax(dim=1, keepdim=True) / top).clamp(min=1e-12)
    q = round_to_grid(w / scale, kind)
    return q.to(torch.float8_e4m3fn if kind == "fp8" else torch.int8), scale


def round_to_grid(v: torch.Tensor, kind: str) -> torch.Tensor:
    """v (already divided by its scale) rounded to the nearest FP8 e4m3 (saturating) or INT8 value, as float32."""
    if kind == "fp8":
        return v.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return torch.round(v.float()).clamp(-128, 127)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()


def fake_quantize_activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Dynamic per-token symmetric quantization of x [..., in] (one scale per row, from its max |x|), then back
    to float: what a W8A8 GEMM sees of its input."""
    assert kind in KINDS, kind
    top = FP8_MAX if kind == "fp8" else INT8_MAX
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / top).clamp(min=_MIN_SCALE)
    if kind == "fp8":
        q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        q = torch.round(xf / scale).clamp(-128, 127)
    return (q * scale).to(x.dtype)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors "pack-quantized" for 8 bits: int8 [out, in] -> int32 [out, in/4], q + 128 in byte i%4."""
    from vserve.quantize.formats import pack_int32

    return pack_int32(q.to(torch.int64) + 128, bits=8)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    from vserve.quantize.formats import unpack_int32

    return (unpack_int32(packed, bits=8) - 128).to(torch.int8)
