"""Round-to-nearest (RTN) asymmetric per-group quantization: the baseline the other methods improve on."""

import torch


def group_index(in_features: int, group_size: int) -> torch.Tensor:
    """g_idx for contiguous groups: input channel i belongs to group i // group_size."""
    if group_size < 1 or in_features % group_size:
        raise ValueError(f"group_size must divide in_features ({in_features}), got {group_size}")
    return torch.arange(in_features, dtype=torch.int32) // group_size


def quant_params(w: torch.Tensor, bits: int, sym: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per row of w [rows, k]. Asymmetric: the range always includes 0 so zero is a valid code.
    Symmetric (AutoGPTQ's): zero is the middle code 2^(bits-1) and scale = 2 max|w| / (2^bits - 1)."""
    maxq = 2**bits - 1
    if sym:
        scale = (2 * w.abs().amax(dim=1) / maxq).clamp(min=1e-10)
        return scale, torch.full_like(scale, (maxq + 1) // 2)
    wmax = w.amax(dim=1).clamp(min=0)
    wmin = w.amin(dim=1).clamp(max=0)
    scale = ((wmax - wmin) / maxq).clamp(min=1e-10)  # an all-zero row still gets a usable scale
    zero = torch.round(-wmin / scale).clamp(0, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes clamp(round(w / scale) + zero, 0, 2^bits - 1), broadcasting scale/zero over w's last dim."""
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def quantize_rtn(w: torch.Tensor, bits: int = 4, group_size: int = 128) -> tuple[torch.Tensor, ...]:
    """w [out, in] -> (q int32 [out, in], zeros int32 [out, in/group], scales float32 [out, in/group])."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    out_features, in_features = w.shape
    group_index(in_features, group_size)  # validates group_size
    wg = w.float().reshape(out_features, in_features // group_size, group_size)
    scale, zero = quant_params(wg.reshape(-1, group_size), bits)
    scale = scale.reshape(out_features, -1)
    zero = zero.reshape(out_features, -1)
    q = quantize_codes(wg, scale[..., None], zero[..., None], bits).reshape(out_features, in_features)
    return q.to(torch.int32), zero.to(torch.int32), scale


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """(q - z) * s in float32 [out, in], where input channel i uses group g_idx[i] of zeros/scales [out, groups]."""
    g = g_idx.long().to(q.device)
    return (q.float() - zeros.float()[:, g]) * scales.float()[:, g]


def fake_quantize(w: torch.Tensor, bits: int = 4, group_size: int = 128) -> torch.Tensor:
    """RTN quantize then dequantize: the weight the quantized model would actually use, in float32. The same numbers
    as dequantize(*quantize_rtn(w), g_idx), computed in the groups' shape (no int codes, no gather by g_idx: AWQ
    calls this 30 times per group of linears)."""
    out_features, in_features = w.shape
    group_index(in_features, group_size)  # validates group_size
    wg = w.float().reshape(out_features, in_features // group_size, group_size)
    scale, zero = quant_params(wg.reshape(-1, group_size), bits)
    scale, zero = scale.reshape(out_features, -1, 1), zero.reshape(out_features, -1, 1)
    return ((quantize_codes(wg, scale, zero, bits) - zero) * scale).reshape(out_features, in_features)
