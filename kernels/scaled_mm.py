"""W8A8 GEMMs: activations quantized per token on the fly, weights per output channel (FP8 e4m3 or INT8).

`fp8_mm` / `int8_mm` take activations already quantized (by per_token_quant, or by the kernel that produced
them: triton_ops' rms_norm_quant, silu_and_mul_quant); `fp8_linear` / `int8_linear` quantize x first. On CUDA
the GEMMs are torch._scaled_mm and torch._int_mm (cuBLASLt); bf16 FP8 GEMMs use cuBLASLt's fast accumulation
(fast_accum, default FAST_ACCUM), so they match the reference to within bf16 rounding rather than to the fp32 sum;
decode-sized FP8 GEMMs of the shapes in FP8_SPLITK (splitk_table) take the Triton split-K kernel. The `_ref`
versions (same signatures) emulate those numerics on any device: the CPU path and the oracle. FP8 products are
exact in fp32 and summed in fp32; INT8 products are summed exactly (as the int32 accumulator does) in float64.
Both then scale by x_scale * w_scale in fp32 and round to the output dtype (x's, for the linears).
"""

from __future__ import annotations

from functools import cache

import torch

from vserve.kernels.ops_ref import per_token_quant_ref


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def fp8_mm_ref(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """xq float8_e4m3fn [..., K] with x_scale float32 [..., 1] (per token), weight float8_e4m3fn [N, K],
    weight_scale float32 [N, 1] -> [..., N] in out_dtype."""
    acc = _rows(xq).float() @ weight.float().t()
    return (acc * _rows(x_scale) * weight_scale.reshape(1, -1)).to(out_dtype).view(*xq.shape[:-1], -1)


def int8_mm_ref(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """xq int8 [..., K] with x_scale float32 [..., 1], weight int8 [N, K], weight_scale float32 [N, 1] -> [..., N]."""
    acc = (_rows(xq).double() @ weight.double().t()).float()  # exact integer sums, as _int_mm's int32
    return (acc * _rows(x_scale) * weight_scale.reshape(1, -1)).to(out_dtype).view(*xq.shape[:-1], -1)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32), weight float8_e4m3fn [N, K], weight_scale float32 [N, 1] -> [..., N]."""
    xq, xs = per_token_quant_ref(_rows(x), torch.float8_e4m3fn)
    return fp8_mm_ref(xq, xs, weight, weight_scale, x.dtype).view(*x.shape[:-1], -1)


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight int8 [N, K], weight_scale float32 [N, 1] -> [..., N]."""
    xq, xs = per_token_quant_ref(_rows(x), torch.int8)
    return int8_mm_ref(xq, xs, weight, weight_scale, x.dtype).view(*x.shape[:-1], -1)


# torch._scaled_mm's use_fast_accum for bf16 outputs, as vLLM's sm90 FP8 GEMMs: 5-10% faster, and its error stays
# at bf16's rounding (K = 14336: twice it). fp16 and fp32 outputs keep cuBLAS's exact accumulation (H200,
# docs/performance.md), except where FP8_SPLITK sends a decode batch to the Triton kernel, whose FP8 dots accumulate
# as fast accumulation does for bf16 and fp16 outputs alike (fp16 relative errors 2.4e-3 to 4.9e-3 on Llama-3-8B's
# shapes).
FAST_ACCUM = True


def _L(block_m: int, block_n: int, split_k: int, num_warps: int, num_stages: int, block_k: int = 128,
       swap: bool = False) -> dict:
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                num_stages=num_stages, swap=swap)


# Where the Triton split-K FP8 GEMM (kernels/triton_fp8_mm.py) beats torch._scaled_mm: (K, N) -> ((most rows,
# launch or None for cuBLAS), ...) in increasing rows, for compute capability 9.0. Tuned on an H200 with the weights
# out of L2, as each GEMM of a decode step finds them (benchmarks/kernels/w8a8.py --tune prints such a table: the
# fastest of a launch grid, swapped tiles included, at the CUDA-graph batch sizes 16 to 256 where it took under
# 0.97x cuBLAS's time; docs/performance.md) for Llama-3-8B's four linears. Other shapes and row counts (prefill
# chunks) go to torch._scaled_mm: cuBLAS runs all four with 128 x 128 tiles, which leaves most SMs idle at N = 4096
# and a few dozen rows; from ~100 rows the Triton kernel's FP8 dots (~800 TFLOP/s here) fall behind cuBLAS's on
# gate_up.
FP8_SPLITK: dict[tuple[int, int], tuple[tuple[int, dict | None], ...]] = {
    (4096, 6144): ((16, _L(16, 64, 1, 4, 8, swap=True)), (32, _L(32, 64, 1, 4, 4, 256, swap=True)),
                   (64, _L(64, 64, 1, 4, 4, 256)), (128, _L(64, 64, 1, 4, 5))),  # qkv_proj
    (4096, 4096): ((16, _L(16, 64, 1, 4, 8, swap=True)), (48, _L(32, 64, 1, 4, 4, 256, swap=True)),
                   (128, _L(64, 64, 1, 4, 4, 256)), (256, _L(64, 64, 1, 4, 5))),  # o_proj
    (4096, 28672): ((16, _L(16, 128, 1, 4, 3, 256, swap=True)), (32, _L(32, 128, 1, 4, 4, swap=True)),
                    (64, _L(64, 128, 1, 4, 4))),  # gate_up_proj
    (14336, 4096): ((16, _L(16, 64, 2, 4, 8, swap=True)), (32, _L(32, 64, 2, 4, 4, 256, swap=True)),
                    (64, _L(64, 64, 2, 4, 4, 256)), (128, _L(64, 64, 1, 4, 4, 256)), (192, _L(64, 64, 1, 4, 5))),
}


def fp8_splitk_launch(M: int, K: int, N: int, device: torch.device, table: dict = FP8_SPLITK) -> dict | None:
    """The split-K launch of table (as FP8_SPLITK) for an [M, K] x [K, N] FP8 GEMM on device, or None for
    torch._scaled_mm."""
    if device.type != "cuda" or _capability(device) != (9, 0):
        return None
    return table_launch(table.get((K, N), ()), M)


def table_launch(entries: tuple[tuple[int, dict | None], ...], M: int) -> dict | None:
    """The launch of the first entry (most rows, launch) with M <= most rows: None past the last entry, or where the
    entry's launch is None (cuBLAS for the row counts it serves)."""
    return next((cfg for most, cfg in entries if M <= most), None)


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@cache
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def fp8_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           out_dtype: torch.dtype, *, fast_accum: bool = FAST_ACCUM, splitk_table: dict = FP8_SPLITK) -> torch.Tensor:
    """As fp8_mm_ref, through torch._scaled_mm (compute capability >= 8.9; bf16 outputs with fast_accum), or the
    Triton split-K GEMM where splitk_table (as FP8_SPLITK; {}: cuBLAS only) says it is faster."""
    xq2, xs, ws = _rows(xq), _rows(x_scale), weight_scale.reshape(1, -1)
    launch = fp8_splitk_launch(xq2.shape[0], xq2.shape[1], weight.shape[0], xq.device, splitk_table) \
        if out_dtype in (torch.bfloat16, torch.float16) else None
    if launch is not None:
        from vserve.kernels.triton_fp8_mm import fp8_mm_splitk

        return fp8_mm_splitk(xq2, xs, weight, weight_scale, out_dtype, **launch).view(*xq.shape[:-1], -1)
    if out_dtype == torch.bfloat16:  # row-wise scales are applied inside the GEMM (bf16 output only)
        y = torch._scaled_mm(xq2, weight.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16,
                              use_fast_accum=fast_accum)
    else:
        one = _one(xq.device)
        y = torch._scaled_mm(xq2, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32) * xs * ws
        y = y.to(out_dtype)
    return y.view(*xq.shape[:-1], -1)


def int8_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
    """As int8_mm_ref, through torch._int_mm (which needs more than 16 rows: fewer are padded)."""
    xq2 = _rows(xq)
    m = xq2.shape[0]
    if m <= 16:
        xq2 = torch.cat([xq2, xq2.new_zeros(17 - m, xq2.shape[1])])
    acc = torch._int_mm(xq2, weight.t())[:m]
    return (acc.float() * _rows(x_scale) * weight_scale.reshape(1, -1)).to(out_dtype).view(*xq.shape[:-1], -1)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, fast_accum: bool = FAST_ACCUM,
               splitk_table: dict = FP8_SPLITK) -> torch.Tensor:
    """As fp8_linear_ref: per_token_quant, then fp8_mm (with its keywords)."""
    from vserve.kernels.triton_ops import per_token_quant

    xq, xs = per_token_quant(_rows(x), torch.float8_e4m3fn)
    return fp8_mm(xq, xs, weight, weight_scale, x.dtype, fast_accum=fast_accum,
                  splitk_table=splitk_table).view(*x.shape[:-1], -1)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """As int8_linear_ref: per_token_quant, then int8_mm."""
    from vserve.kernels.triton_ops import per_token_quant

    xq, xs = per_token_quant(_rows(x), torch.int8)
    return int8_mm(xq, xs, weight, weight_scale, x.dtype).view(*x.shape[:-1], -1)
