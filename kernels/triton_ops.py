"""Triton kernels for the non-attention ops: RMSNorm (with the residual add fused in), SiLU-and-mul, RoPE, and
per-token quantization for W8A8 linears, alone or fused into the RMSNorm / SiLU-and-mul producing their input.

Each matches its reference in kernels/ops_ref.py (same signature, same rounding points, new output tensors;
inputs are never written). Math is fp32 in registers; inputs fp16/bf16/fp32 with a contiguous last dim.
Launch parameters are chosen by size and can be overridden by keyword for benchmarking.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vserve.kernels.scaled_mm import _capability

# Programmatic dependent launch (Hopper and later): RMSNorm, SiLU-and-mul, RoPE, the KV store, decode attention
# and the AWQ GEMV let the next kernel's programs be scheduled while they run, and each waits for its predecessor's
# results (griddepcontrol.wait) before touching memory: in a CUDA graph of batch-1 decode the programs of a kernel
# are then resident when the one before it ends (H200, batch-1 decode: +3.7% AWQ, +1.2% bf16, docs/performance.md).
# VSERVE_DISABLE_PDL=1 launches them as before.
PDL = True


def _row_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] with a unit stride along n (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """With PDL (a kernel launched by pdl_launch's options): wait until the kernel before this one has finished
    and its writes are visible, then let the next kernel's programs be scheduled. Call before any global load or
    store: a program may start while the previous kernel still runs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch(device: torch.device) -> dict:
    """The PDL constexpr and launch option for a kernel on device: on when PDL is (and VSERVE_DISABLE_PDL is not
    set), on NVIDIA GPUs of compute capability 9.0 or more, outside the interpreter (the kernel then calls pdl_enter
    first)."""
    on = PDL and os.environ.get("VSERVE_DISABLE_PDL", "0") in ("", "0") and device.type == "cuda" and _ptx() and \
        _capability(device) >= (9, 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr, N, stride_x, stride_r, stride_o, stride_ro,
                     eps, qmax, min_scale, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, IS_FP8: tl.constexpr,
                     HW_FP8: tl.constexpr, Q_ALIGN: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # rounded to the input dtype, as torch's x + residual is
        x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    if QUANT:  # out gets the codes of y as rms_norm stores it (rounded to x's dtype), s the row's scale
        # The codes' row is declared Q_ALIGN-byte aligned, no more: the alignment rms_norm's stores of y have in
        # values. Triton then spreads the row over the threads as in rms_norm (a 16-byte int8 store would give each
        # thread twice the values), so the sum of squares is added in the same order and y is rms_norm's, bit for
        # bit.
        q_row = out_ptr + tl.multiple_of(row * stride_o, Q_ALIGN)
        _quant_row(y.to(x.dtype).to(tl.float32), q_row + cols, s_ptr + row, mask, qmax, min_scale, IS_FP8, HW_FP8)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm(x, residual, weight, eps, num_warps, quant_dtype=None):
    """(rms_norm(x [+ residual]), the new residual or None); with quant_dtype the first is (codes, scales)."""
    n = x.shape[-1]
    assert weight.shape == (n,), (weight.shape, n)
    x2 = _rows(x)
    r2 = x2 if residual is None else _rows(residual)
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(h_dtype, weight.dtype)
    # quantizing, the kernel rounds the normed rows to x's dtype (which weight and residual must share)
    assert quant_dtype is None or x.dtype == weight.dtype == h_dtype, (x.dtype, h_dtype, weight.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype if quant_dtype is None else quant_dtype, device=x.device)
    new_res = out if residual is None else torch.empty(x2.shape, dtype=h_dtype, device=x.device)
    scale = out if quant_dtype is None else torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    # rms_norm stores 16 bytes of y at a time where Triton knows the row stride divides by 16, else one value
    q_align = 16 // x.element_size() if out.stride(0) % 16 == 0 else 1
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight.contiguous(), out, new_res, scale, n, x2.stride(0), r2.stride(0),
                                     out.stride(0), new_res.stride(0), eps, HAS_RESIDUAL=residual is not None,
                                     QUANT=quant_dtype is not None, Q_ALIGN=q_align, BLOCK=block,
                                     num_warps=num_warps or _row_warps(block), **_quant_args(quant_dtype),
                                     **pdl_launch(x.device))
    y = out.view(x.shape) if quant_dtype is None else (out.view(x.shape), scale.view(*x.shape[:-1], 1))
    return y, None if residual is None else new_res.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, num_warps: int | None = None) -> torch.Tensor:
    """RMSNorm over the last dim (as rms_norm_ref); returns a new tensor."""
    return _rms_norm(x, None, weight, eps, num_warps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass (as fused_add_rms_norm_ref); new tensors."""
    assert x.shape == residual.shape, (x.shape, residual.shape)
    return _rms_norm(x, residual, weight, eps, num_warps)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype, *,
                   num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_quant(rms_norm(x)) in one pass (as rms_norm_quant_ref): (xq [..., K] fp8/int8, scale [..., 1]
    float32), the same codes and scales as the two kernels give."""
    return _rms_norm(x, None, weight, eps, num_warps, dtype)[0]


def fused_add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             dtype: torch.dtype, *, num_warps: int | None = None):
    """((xq, scale) of rms_norm(x + residual), x + residual) in one pass (as fused_add_rms_norm_quant_ref)."""
    assert x.shape == residual.shape, (x.shape, residual.shape)
    return _rms_norm(x, residual, weight, eps, num_warps, dtype)


@triton.jit
def _silu_mul(x_row, cols, mask, N):
    """silu(gate) * up at cols of a row x = [gate | up] (N each), in x's dtype; silu is rounded to that dtype
    before the product, as F.silu(gate) * up is."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + N + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_row.dtype.element_ty).to(tl.float32)
    return (act * up).to(x_row.dtype.element_ty)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    tl.store(out_ptr + row * stride_o + cols, _silu_mul(x_ptr + row * stride_x, cols, mask, N), mask=mask)


def silu_and_mul(x: torch.Tensor, *, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """x [..., 2N] = [gate | up] -> silu(gate) * up [..., N] (as silu_and_mul_ref); a new tensor."""
    n = x.shape[-1] // 2
    assert x.shape[-1] == 2 * n, x.shape
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(block, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, n, x2.stride(0), out.stride(0), BLOCK=block,
                                                               num_warps=num_warps, **pdl_launch(x.device))
    return out.view(*x.shape[:-1], n)


@triton.jit
def _rotated_halves(x_ptr, stride_h, mask, half, c, s, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate-half RoPE of the heads at x_ptr ([BLOCK_H, BLOCK_HALF] tiles, rows h * stride_h): the two rotated
    halves in fp32 (the caller rounds them)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    x1 = tl.load(x_ptr + h * stride_h + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + h * stride_h + half + j, mask=mask, other=0.0).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_h, stride_oh, num_heads, half, c, s, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (j < half)
    r1, r2 = _rotated_halves(x_ptr, stride_h, mask, half, c, s, BLOCK_H, BLOCK_HALF)
    dtype = o_ptr.dtype.element_ty
    tl.store(o_ptr + h * stride_oh + j, r1.to(dtype), mask=mask)
    tl.store(o_ptr + h * stride_oh + half + j, r2.to(dtype), mask=mask)


@triton.jit
def _rope_row(pos_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin, half, BLOCK_HALF: tl.constexpr):
    """The cos and sin rows ([1, BLOCK_HALF], fp32, zero past half) of the position at pos_ptr."""
    pos = tl.load(pos_ptr).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(cos_ptr + pos * stride_cos + j, mask=j < half, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + j, mask=j < half, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos, stride_sin, H, KVH, half,
                   BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c, s = _rope_row(pos_ptr + t, cos_ptr, sin_ptr, stride_cos, stride_sin, half, BLOCK_HALF)
    _rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, H, half, c, s, BLOCK_H,
                  BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, stride_kh, stride_koh, KVH, half, c, s, BLOCK_KVH,
                  BLOCK_HALF)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, *, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE (as rotary_embedding_ref): q [T, H, d], k [T, kvh, d], cos/sin [max_pos, d/2], positions
    [T] -> new rotated q, k (the inputs, often views of the packed qkv projection, are not written)."""
    T, H, d = q.shape
    kvh = k.shape[1]
    half = d // 2
    assert k.shape == (T, kvh, d) and cos.shape[-1] == half and sin.shape[-1] == half, (q.shape, k.shape, cos.shape)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                       device=k.device)
    if T == 0:
        return q_out, k_out
    _rotary_kernel[(T,)](positions.contiguous(), q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1),
                         k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0),
                         k_out.stride(1), cos.stride(0), sin.stride(0), H, kvh, half, BLOCK_H=triton.next_power_of_2(H),
                         BLOCK_KVH=triton.next_power_of_2(kvh), BLOCK_HALF=triton.next_power_of_2(half),
                         num_warps=num_warps, **pdl_launch(q.device))
    return q_out, k_out


@triton.jit
def _round_half_even(v):
    f = tl.floor(v)
    d = v - f  # exact: f and v are close
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def round_to_e4m3(v):
    """fp32 v rounded to the nearest float8 e4m3fn value (ties to even, saturating at +-448), still in fp32, so
    that converting it to fp8 is exact (Triton's interpreter rounds some values wrongly when it converts)."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(v), 448.0)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # exponent; subnormals share -6
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): e4m3's spacing at |v|
    inv = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)  # 1 / step, exactly
    r = tl.minimum(_round_half_even(a * inv) * step, 448.0)
    return r * tl.where(bits < 0, -1.0, 1.0)  # the sign, -0 included (Triton's -x is 0 - x, which gives +0)


@triton.jit
def _quant_values(x, scale, IS_FP8: tl.constexpr, HW_FP8: tl.constexpr):
    v = tl.math.div_rn(x, scale)  # IEEE division, as torch's
    if IS_FP8:
        if not HW_FP8:
            v = round_to_e4m3(v)
        # else the conversion itself rounds to nearest even and saturates at +-448 (cvt.rn.satfinite on sm89+)
    else:
        v = tl.minimum(tl.maximum(_round_half_even(v), -128.0), 127.0)
    return v


@triton.jit
def _store_quant(ptr, v, mask, IS_FP8: tl.constexpr):
    if IS_FP8:
        tl.store(ptr, v.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_scale(amax, qmax, min_scale):
    return tl.maximum(tl.math.div_rn(amax, qmax), min_scale)  # IEEE division, as torch's


@triton.jit
def _quant_row(x, q_ptrs, s_ptr, mask, qmax, min_scale, IS_FP8: tl.constexpr, HW_FP8: tl.constexpr):
    """Quantize a whole row held in registers (fp32, 0 where masked): store its scale and its codes."""
    scale = _token_scale(tl.max(tl.abs(x), axis=0), qmax, min_scale)
    tl.store(s_ptr, scale)
    _store_quant(q_ptrs, _quant_values(x, scale, IS_FP8, HW_FP8), mask, IS_FP8)


@triton.jit
def _row_values(x_row, k, K, SILU_AND_MUL: tl.constexpr):
    """Values k of a row in fp32, 0 from K on: x's own, or silu(gate) * up (in x's dtype) for x = [gate | up]."""
    if SILU_AND_MUL:
        v = _silu_mul(x_row, k, k < K, K)
    else:
        v = tl.load(x_row + k, mask=k < K, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, qmax, min_scale, SILU_AND_MUL: tl.constexpr,
                            IS_FP8: tl.constexpr, HW_FP8: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program. A row that fits in one BLOCK is read once and kept in registers; a longer one is
    read twice (the max, then the values; the second read hits L2). SILU_AND_MUL: the row quantized is
    silu_and_mul of x's row, computed on each read."""
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    if BLOCK >= K:
        k = tl.arange(0, BLOCK)
        _quant_row(_row_values(x_row, k, K, SILU_AND_MUL), q_row + k, s_ptr + row, k < K, qmax, min_scale, IS_FP8,
                   HW_FP8)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):  # pass 1: max |x| of the row
            k = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_row_values(x_row, k, K, SILU_AND_MUL)))
        scale = _token_scale(tl.max(amax, axis=0), qmax, min_scale)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):  # pass 2: quantize (the row is in L2 by now)
            k = k0 + tl.arange(0, BLOCK)
            v = _quant_values(_row_values(x_row, k, K, SILU_AND_MUL), scale, IS_FP8, HW_FP8)
            _store_quant(q_row + k, v, k < K, IS_FP8)


_ARRIVALS: dict[str, torch.Tensor] = {}
ARRIVAL_SLOTS = 1 << 16


def arrival_counts(device: torch.device, n: int) -> torch.Tensor | None:
    """Zeroed int32 counts for kernels whose last program to arrive combines the others' partials (an atomic count
    each; every launch leaves its counts at 0 again, CUDA-graph replays included). One buffer a device, shared by
    those kernels: launches on one stream run one after another. None when n is more than it holds, or when it
    would first be allocated inside a CUDA-graph capture: the caller then takes its two-kernel path."""
    if n > ARRIVAL_SLOTS:
        return None
    key = str(device)
    if key not in _ARRIVALS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _ARRIVALS[key] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    return _ARRIVALS[key]


def _interpreted() -> bool:
    """Under TRITON_INTERPRET=1 (CI's CPU path), whose fp8 conversion rounds some values wrongly."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _ptx() -> bool:
    """Whether kernels may carry inline NVIDIA PTX (tl.inline_asm_elementwise): not under the interpreter, not on
    ROCm; the kernels that do have a plain-Triton path for those."""
    return torch.version.hip is None and not _interpreted()


def _quant_args(dtype: torch.dtype | None) -> dict:
    """The quantizing kernels' arguments for codes of dtype (float8_e4m3fn or int8; None: not quantizing)."""
    from vserve.kernels.ops_ref import FP8_MAX, INT8_MAX, MIN_SCALE

    assert dtype in (None, torch.float8_e4m3fn, torch.int8), dtype
    fp8 = dtype == torch.float8_e4m3fn
    return dict(qmax=FP8_MAX if fp8 else INT8_MAX, min_scale=MIN_SCALE, IS_FP8=fp8, HW_FP8=fp8 and not _interpreted())


def _quant_rows(x2: torch.Tensor, K: int, dtype: torch.dtype, silu_and_mul: bool, block: int,
                num_warps: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    M = x2.shape[0]
    q = torch.empty(M, K, dtype=dtype, device=x2.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x2.device)
    if M == 0:
        return q, s
    blk = min(block, triton.next_power_of_2(K))
    if num_warps is None:
        num_warps = max(4, min(16, blk // 512))
    _per_token_quant_kernel[(M,)](x2, q, s, K, x2.stride(0), q.stride(0), SILU_AND_MUL=silu_and_mul, BLOCK=blk,
                                  num_warps=num_warps, **_quant_args(dtype))
    return q, s


def per_token_quant(x: torch.Tensor, dtype: torch.dtype, *, block: int = 16384,
                    num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As per_token_quant_ref: x [M, K] -> (xq [M, K] fp8/int8, scale [M, 1] float32), new tensors. Rows up to
    `block` long are read once; num_warps defaults to one per 512 values of the row (4 to 16)."""
    x2 = _rows(x)
    return _quant_rows(x2, x2.shape[1], dtype, False, block, num_warps)


def silu_and_mul_quant(x: torch.Tensor, dtype: torch.dtype, *, block: int = 16384,
                       num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_quant(silu_and_mul(x)) in one kernel (as silu_and_mul_quant_ref): x [..., 2N] -> (xq [..., N],
    scale [..., 1]), the same codes and scales as the two kernels give; launched as per_token_quant is."""
    n = x.shape[-1] // 2
    assert x.shape[-1] == 2 * n, x.shape
    q, s = _quant_rows(_rows(x), n, dtype, True, block, num_warps)
    return q.view(*x.shape[:-1], n), s.view(*x.shape[:-1], 1)
