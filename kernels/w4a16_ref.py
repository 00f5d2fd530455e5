"""Pure-torch reference for the weight-only quantized GEMM (the CPU path and the oracle for
kernels/triton_w4a16.py): dequantize the checkpoint's tensors, then one matmul.

Layouts (the checkpoint's own, never repacked):
- "awq": qweight int32 [K, N/8] (AutoAWQ GEMM nibble order), qzeros int32 [K/group, N/8], scales [K/group, N];
- "gptq": qweight int32 [K*bits/32, N], qzeros int32 [groups, N*bits/32] (stored minus one), scales [groups, N],
  g_idx int32 [K] (input channel -> group; None: contiguous groups of group_size);
- "pack" (compressed-tensors pack-quantized): qweight int32 [N, K*bits/32] packed along K, codes q + 2^(bits-1)
  (symmetric), scales [N, groups]; qzeros unused;
- "channel": qweight int8 or float8_e4m3fn [N, K] (symmetric), scales [N, 1] or [N]; qzeros, g_idx unused;
- "tc": 4-bit codes repacked at load for the tensor-core kernel (kernels/w4a16_repack.py): qweight int32 [N, Kp/8],
  scales [G, N], qzeros int32 [G, N/8] or None (symmetric), g_idx: act-order's K permutation (perm) or None;
  group_size: the repack's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vserve.kernels.w4a16_repack import tc_dequantize
from vserve.quantize.formats import unpack_awq, unpack_gptq, unpack_int32
from vserve.quantize.rtn import dequantize, group_index

LAYOUTS = ("awq", "gptq", "pack", "channel", "tc")


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                      g_idx: torch.Tensor | None, layout: str, bits: int, group_size: int,
                      k: int | None = None) -> torch.Tensor:
    """W [N, K] float32 = (q - z[g]) * s[g] (awq, gptq, pack, tc) or q * s (channel). k: the tc layout's unpadded K
    (default: its padded K, or act-order's)."""
    if layout == "tc":
        if k is None:
            k = g_idx.numel() if g_idx is not None else qweight.shape[1] * 8
        return tc_dequantize(qweight, scales, qzeros, g_idx, group_size, k)
    if layout == "channel":
        return qweight.float() * scales.float().reshape(-1, 1)
    if layout == "awq":
        q, zeros, s = unpack_awq(qweight, qzeros, scales)
    elif layout == "gptq":
        q, zeros, s, _ = unpack_gptq(qweight, qzeros, scales, g_idx, bits)
    elif layout == "pack":
        q, s = unpack_int32(qweight, bits), scales
        zeros = torch.full_like(s, 2 ** (bits - 1), dtype=torch.int32)
    else:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    g = group_index(q.shape[1], group_size) if g_idx is None else g_idx
    return dequantize(q, zeros, s, g.to(q.device))


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                   g_idx: torch.Tensor | None, layout: str, bits: int, group_size: int) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype: W rounded to x's dtype (what the kernel feeds its dot),
    products summed in fp32."""
    w = dequantize_weight(qweight, scales, qzeros, g_idx, layout, bits, group_size, x.shape[-1]).to(x.dtype)
    return F.linear(x.float(), w.float()).to(x.dtype)
