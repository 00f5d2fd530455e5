"""Checkpoint layouts for 4-bit weights: AutoAWQ "GEMM" and GPTQ (AutoGPTQ), packed into int32.

Both take and return the unpacked form used across vserve.quantize: codes q [out, in] (nn.Linear layout),
zeros and scales [out, groups], and g_idx [in] mapping input channel -> group.
"""

import torch

from vserve.quantize.rtn import dequantize, group_index

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of each int32 holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 32 bits of an int64 tensor as int32 (a top nibble >= 8 sets the sign bit)."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_int32(values: torch.Tensor, bits: int = 4, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned codes along the last dim, 32/bits per int32; field i holds element order[i] of each chunk."""
    per = 32 // bits
    if values.shape[-1] % per:
        raise ValueError(f"last dim must be a multiple of {per} to pack {bits}-bit values, got {values.shape[-1]}")
    order = order or tuple(range(per))
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per)[..., list(order)] & (2**bits - 1)
    shifts = torch.arange(per, dtype=torch.int64, device=values.device) * bits
    return _to_int32((v << shifts).sum(-1))


def unpack_int32(packed: torch.Tensor, bits: int = 4, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of pack_int32: int32 [..., n] -> int32 codes [..., n * 32/bits]."""
    per = 32 // bits
    order = order or tuple(range(per))
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    fields = (packed[..., None] >> shifts) & (2**bits - 1)  # arithmetic shift is fine: the mask drops sign bits
    inverse = [order.index(j) for j in range(per)]
    return fields[..., inverse].reshape(*packed.shape[:-1], -1)


# --- AutoAWQ "GEMM" (quant_method awq, version gemm): 4-bit, contiguous groups ---


def pack_awq(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in], zeros/scales [out, in/group]) -> qweight int32 [in, out/8], qzeros int32 [in/group, out/8],
    scales fp16 [in/group, out]."""
    qweight = pack_int32(q.t(), 4, AWQ_ORDER)
    qzeros = pack_int32(zeros.t(), 4, AWQ_ORDER)
    return qweight, qzeros, scales.t().to(torch.float16).contiguous()


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_awq: -> q int32 [out, in], zeros int32 [out, groups], scales fp16 [out, groups]."""
    q = unpack_int32(qweight, 4, AWQ_ORDER).t().contiguous()
    zeros = unpack_int32(qzeros, 4, AWQ_ORDER).t().contiguous()
    return q, zeros, scales.t().contiguous()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [out, in] float32 = (q - z) * s from the AWQ GEMM tensors."""
    q, zeros, s = unpack_awq(qweight, qzeros, scales)
    return dequantize(q, zeros, s, group_index(q.shape[1], group_size))


# --- GPTQ (AutoGPTQ): qweight packed along the input dim, qzeros stored minus one, g_idx for act-order ---


def pack_gptq(
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int = 4,
    sym: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in], zeros/scales [out, groups], g_idx [in]) -> qweight int32 [in*bits/32, out],
    qzeros int32 [groups, out*bits/32] holding zero - 1, scales fp16 [groups, out], g_idx int32 [in]."""
    if bits not in (4, 8):
        raise ValueError(f"GPTQ packing supports bits 4 or 8, got {bits}")
    if sym and not bool((zeros == 2 ** (bits - 1)).all()):
        raise ValueError(f"sym=True needs every zero point to be {2 ** (bits - 1)}")
    if g_idx.shape != (q.shape[1],):
        raise ValueError(f"g_idx must have one entry per input channel ({q.shape[1]}), got {tuple(g_idx.shape)}")
    qweight = pack_int32(q, bits).t().contiguous()  # sequential fields along in, one column per output
    qzeros = pack_int32(zeros.t() - 1, bits)  # the "minus one" AutoGPTQ convention; zero 0 is stored as all ones
    return qweight, qzeros, scales.t().to(torch.float16).contiguous(), g_idx.to(torch.int32)


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_gptq: -> q int32 [out, in], zeros int32 [out, groups], scales fp16 [out, groups], g_idx."""
    q = unpack_int32(qweight.t(), bits).contiguous()
    zeros = (unpack_int32(qzeros, bits) + 1) & (2**bits - 1)  # masked so a stored all-ones field reads as 0
    return q, zeros.t().contiguous(), scales.t().contiguous(), g_idx


def dequantize_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int = 4
) -> torch.Tensor:
    """W [out, in] float32 = (q - z[g_idx]) * s[g_idx] from the GPTQ tensors."""
    q, zeros, s, g = unpack_gptq(qweight, qzeros, scales, g_idx, bits)
    return dequantize(q, zeros, s, g)
