"""W8A8 GEMMs: activations quantized per token on the fly, weights per output channel (FP8 e4m3 or INT8).

On CUDA `fp8_linear` runs torch._scaled_mm and `int8_linear` torch._int_mm (cuBLASLt), after the Triton
per-token quantization; bf16 FP8 GEMMs use cuBLASLt's fast accumulation (FAST_ACCUM), so they match the
reference to within bf16 rounding rather than to the fp32 sum. The `_ref` versions (same signatures) emulate
those numerics on any device: the CPU path and the oracle. FP8 products are exact in fp32 and summed in fp32;
INT8 products are summed exactly (as the int32 accumulator does) in float64. Both then scale by
x_scale * w_scale in fp32 and round to x's dtype.
"""

from __future__ import annotations

from functools import cache

import torch

from vserve.kernels.ops_ref import per_token_quant_ref


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32), weight float8_e4m3fn [N, K], weight_scale float32 [N, 1] -> [..., N]."""
    xq, xs = per_token_quant_ref(_rows(x), torch.float8_e4m3fn)
    acc = xq.float() @ weight.float().t()
    return (acc * xs * weight_scale.reshape(1, -1)).to(x.dtype).view(*x.shape[:-1], -1)


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight int8 [N, K], weight_scale float32 [N, 1] -> [..., N]."""
    xq, xs = per_token_quant_ref(_rows(x), torch.int8)
    acc = (xq.double() @ weight.double().t()).float()  # exact integer sums, as _int_mm's int32
    return (acc * xs * weight_scale.reshape(1, -1)).to(x.dtype).view(*x.shape[:-1], -1)


# torch._scaled_mm's use_fast_accum for bf16 outputs, as vLLM's sm90 FP8 GEMMs: 5-10% faster, and its error stays
# at bf16's rounding (K = 14336: twice it). fp16 and fp32 outputs keep the exact accumulation (h200_quant fp8mm).
FAST_ACCUM = True


@cache
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """As fp8_linear_ref, through torch._scaled_mm (compute capability >= 8.9)."""
    from vserve.kernels.triton_ops import per_token_quant

    xq, xs = per_token_quant(_rows(x), torch.float8_e4m3fn)
    ws = weight_scale.reshape(1, -1)
    if x.dtype == torch.bfloat16:  # row-wise scales are applied inside the GEMM (bf16 output only)
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16,
                              use_fast_accum=FAST_ACCUM)
    else:
        one = _one(x.device)
        y = (torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32) * xs * ws).to(x.dtype)
    return y.view(*x.shape[:-1], -1)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """As int8_linear_ref, through torch._int_mm (which needs more than 16 rows: fewer are padded)."""
    from vserve.kernels.triton_ops import per_token_quant

    xq, xs = per_token_quant(_rows(x), torch.int8)
    m = xq.shape[0]
    if m <= 16:
        xq = torch.cat([xq, xq.new_zeros(17 - m, xq.shape[1])])
    acc = torch._int_mm(xq, weight.t())[:m]
    return (acc.float() * xs * weight_scale.reshape(1, -1)).to(x.dtype).view(*x.shape[:-1], -1)
