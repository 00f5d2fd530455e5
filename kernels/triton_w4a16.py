"""Triton weight-only quantized GEMM (W4A16, also W8A16): y = x @ W^T with W dequantized in registers.

Matches kernels/w4a16_ref.py:w4a16_gemm_ref (same signature, same layouts: AutoAWQ GEMM, GPTQ 4/8-bit with
an act-order g_idx, compressed-tensors pack-quantized 4/8-bit, and symmetric per-channel int8/fp8 [N, K]). Each
K-tile of codes is unpacked, dequantized as (q - z) * s in fp32, rounded to x's dtype and fed to tl.dot with
fp32 accumulation; AWQ with bf16 or fp16 rows instead feeds tl.dot the exact q - z in x's dtype and multiplies
the group's scales into the dot's fp32 result (`_awq_exact_tile`, AWQ_EXACT).

Four paths by the number of rows M:
- M == 1 (batch-1 decode) on the integer layouts with contiguous groups: a GEMV kernel that applies scale and
  zero once per group and column (y += s (x.q - z sum x)), split over K; for AWQ (fp16 or bf16 rows, up to
  AWQ_GEMV_M of them) `_awq_gemv_kernel`, which works on pairs of fp16 values (two codes an instruction; each
  word's codes decoded once for all the rows of a launch) and sums its split partials itself, for GPTQ and pack
  `_gemv_kernel`;
- M <= 16 (decode): one 16-row tile, and split-K so that a few output tiles still fill the GPU (each split
  writes an fp32 partial; the last program of each output tile to finish sums them in split order);
- 16 < M < DEQUANT_M (DEQUANT_M_WIDE for wide weights): tiled, with larger row tiles;
- M >= DEQUANT_M (larger decode batches, prefills): dequantize the whole weight into x's dtype and hand it to
  cuBLAS (writing and reading a bf16 weight costs less than the tile kernel's dequantization per row tile; one
  buffer of the largest layer's size serves every layer, dequant_buffer).
No call syncs with the host, so decode steps can be captured in CUDA graphs.

Which of these runs at each row count, and whether a weight is instead repacked at load into the "tc" layout for the
tensor-core kernel (kernels/triton_w4a16_tc.py), is the data of kernels/w4a16_configs.json (kernels/w4a16_dispatch.py);
the committed table keeps the thresholds above.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from vserve.kernels import triton_w4a16_tc, w4a16_dispatch
from vserve.kernels.triton_ops import _ptx, arrival_counts, pdl_enter, pdl_launch

# The tuned defaults of w4a16_gemm's keywords (docs/performance.md has the H200 runs; benchmarks/kernels/w4a16.py
# times the kernels with other values passed as those keywords).
# From this many rows on, dequantize + cuBLAS beats the fused kernels (dequant_m; H200, cold L2: qkv, o_proj and
# down_proj from 24 rows; gate_up, N = 28672, not before 96, its many column tiles keeping the tile kernel ahead up to
# 64 rows)
DEQUANT_M, DEQUANT_M_WIDE, WIDE_N = 24, 96, 16384
AWQ_FIXUP_UNROLL = 8  # fixup_unroll: the last program's loads of the K-split partials issued this many at a time
# AWQ rows through _awq_gemv_kernel (gemv_m; the weight's codes decoded once for up to AWQ_GEMV_ROWS rows a launch);
# more rows take the tile kernel. H200: at 2 rows the GEMV beats bf16 cuBLAS per GEMM; from 3 its per-row x
# conversions and fp16 FMAs cost more than the tile kernel's tensor-core dot (batch-3 decode the same either way, at
# 4 rows 1.6-2.4x slower per GEMM)
AWQ_GEMV_M, AWQ_GEMV_ROWS = 2, 8
AWQ_EXACT = True  # exact: the tile kernel's AWQ path, x times the exact codes minus zeros, then the group's scales
_DEQUANT_BUFFERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # see dequant_buffer
_OUTGROWN: list[torch.Tensor] = []
_LAYOUT_IDS = {"awq": 0, "gptq": 1, "channel": 2, "pack": 3}
_FORCED = {"fused": 1 << 62, "dequant": 1}  # dequant_m of the checkpoint layout's forced row paths


@triton.jit
def _field_shifts(BITS: tl.constexpr, AWQ_ORDER: tl.constexpr):
    """Bit offset, inside its int32, of the j-th of the 32/BITS values a word packs: AutoAWQ's nibble order
    (value j in field (0, 4, 1, 5, 2, 6, 3, 7)[j]) when AWQ_ORDER, else field j."""
    j = tl.arange(0, 32 // BITS)
    if AWQ_ORDER:
        shift = ((j // 2) + (j % 2) * 4) * 4
    else:
        shift = j * BITS
    return shift


@triton.jit
def _unpack_cols(word, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, AWQ_ORDER: tl.constexpr):
    """int32 words [R, C] -> codes [R, C * 32/BITS]: each word's values become consecutive columns."""
    PER: tl.constexpr = 32 // BITS
    q = (word[:, :, None] >> _field_shifts(BITS, AWQ_ORDER)[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(q, (R, C * PER))


@triton.jit
def _unpack_rows(word, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr):
    """int32 words [R, C] packed along K -> codes [R * 32/BITS, C]: field j of row r is row r * 32/BITS + j."""
    PER: tl.constexpr = 32 // BITS
    q = (word[:, None, :] >> _field_shifts(BITS, False)[None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(q, (R * PER, C))


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, k_end, n0, N, group_size, stride_qk, stride_qn,
                  stride_sg, stride_sn, stride_zg, LAYOUT: tl.constexpr, BITS: tl.constexpr,
                  HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W^T tile [BLOCK_K, BLOCK_N] in fp32 for input rows k0.. (below k_end) and output columns n0.. (below N).
    Every packed word is loaded once, by consecutive addresses, and split into its fields in registers."""
    PER: tl.constexpr = 32 // BITS
    k = k0 + tl.arange(0, BLOCK_K)
    n = n0 + tl.arange(0, BLOCK_N)
    k_mask, n_mask = k < k_end, n < N
    mask = k_mask[:, None] & n_mask[None, :]
    if HAS_G_IDX:  # act-order: each input row has its own group
        g = tl.load(g_ptr + k, mask=k_mask, other=0)[:, None]
        s = tl.load(s_ptr + g * stride_sg + n[None, :] * stride_sn, mask=mask, other=0.0).to(tl.float32)
    else:  # the tile lies inside one group (the wrapper picks BLOCK_K to make it so)
        g = k0 // group_size
        s = tl.load(s_ptr + g * stride_sg + n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if LAYOUT == 0:  # awq: qweight [K, N/8], qzeros [groups, N/8], 8 columns per int32
        nw = n0 // PER + tl.arange(0, BLOCK_N // PER)
        nw_mask = nw * PER < N
        word = tl.load(qw_ptr + k[:, None] * stride_qk + nw[None, :] * stride_qn,
                       mask=k_mask[:, None] & nw_mask[None, :], other=0)
        q = _unpack_cols(word, BLOCK_K, BLOCK_N // PER, BITS, True)
        if HAS_G_IDX:
            zword = tl.load(z_ptr + g * stride_zg + nw[None, :], mask=k_mask[:, None] & nw_mask[None, :], other=0)
            z = _unpack_cols(zword, BLOCK_K, BLOCK_N // PER, BITS, True)
        else:
            zword = tl.load(z_ptr + g * stride_zg + nw, mask=nw_mask, other=0)[None, :]
            z = _unpack_cols(zword, 1, BLOCK_N // PER, BITS, True)
        w = (q - z).to(tl.float32) * s
    elif LAYOUT == 1 or LAYOUT == 3:  # codes packed along K: gptq [K*BITS/32, N], pack [N, K*BITS/32]
        kw = k0 // PER + tl.arange(0, BLOCK_K // PER)
        word = tl.load(qw_ptr + kw[:, None] * stride_qk + n[None, :] * stride_qn,
                       mask=(kw * PER < k_end)[:, None] & n_mask[None, :], other=0)
        q = _unpack_rows(word, BLOCK_K // PER, BLOCK_N, BITS)
        if LAYOUT == 1:  # gptq's qzeros [groups, N*BITS/32] hold zero - 1
            nw = n0 // PER + tl.arange(0, BLOCK_N // PER)
            nw_mask = nw * PER < N
            if HAS_G_IDX:
                zword = tl.load(z_ptr + g * stride_zg + nw[None, :], mask=k_mask[:, None] & nw_mask[None, :],
                                other=0)
                z = _unpack_cols(zword, BLOCK_K, BLOCK_N // PER, BITS, False)
            else:
                zword = tl.load(z_ptr + g * stride_zg + nw, mask=nw_mask, other=0)[None, :]
                z = _unpack_cols(zword, 1, BLOCK_N // PER, BITS, False)
            z = (z + 1) & ((1 << BITS) - 1)  # masked: a stored all-ones field is zero 0
        else:  # compressed-tensors pack-quantized: symmetric, codes offset by 2^(BITS-1)
            z = 1 << (BITS - 1)
        w = (q - z).to(tl.float32) * s
    else:  # channel: int8 or fp8 [N, K], symmetric
        w = tl.load(qw_ptr + k[:, None] * stride_qk + n[None, :] * stride_qn, mask=mask).to(tl.float32)
        w = tl.where(mask, w, 0.0) * s  # no `other`: 0 does not cast to fp8
    return w


@triton.jit
def _awq_exact_tile(qw_ptr, z_ptr, k0, k_end, n0, N, group_size, stride_qk, stride_zg, BF16: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """AWQ codes minus zeros, q - z, of input rows k0.. (below k_end; the tile inside one group) and output columns
    n0.. (below N) as a [BLOCK_K, BLOCK_N] tile of bf16 (BF16) or fp16: small integers, exact in either, so a dot
    with x's tile sums exact products and the group's scales can multiply its result. ASM: each word's 8 codes in 4
    pairs by lop3 into the magic number of 1024 (fp16; 128 for bf16) + q and one packed sub or fma each (see
    _h2_codes); else in Triton integer ops."""
    nw = n0 // 8 + tl.arange(0, BLOCK_N // 8)
    nw_mask = nw * 8 < N
    k = k0 + tl.arange(0, BLOCK_K)
    word = tl.load(qw_ptr + k[:, None] * stride_qk + nw[None, :], mask=(k < k_end)[:, None] & nw_mask[None, :],
                   other=0)
    zw = tl.load(z_ptr + (k0 // group_size) * stride_zg + nw, mask=nw_mask, other=0)[None, :]
    if ASM:
        if BF16:  # -(128 + z) per pair: 0xC300 | z (-0x3CFF3D00 is 0xC300C300 as an int32); 0x3F80 is 1.0
            m = 0x000F000F
            c = tl.inline_asm_elementwise(
                """{ .reg .b32 t, d, u, one;
                mov.b32 one, 0x3F803F80;
                lop3.b32 t, $8, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 d, t, one, $9; mov.b32 {$0, $1}, d;
                shr.u32 u, $8, 4;
                lop3.b32 t, u, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 d, t, one, $10; mov.b32 {$2, $3}, d;
                shr.u32 u, $8, 8;
                lop3.b32 t, u, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 d, t, one, $11; mov.b32 {$4, $5}, d;
                shr.u32 u, $8, 12;
                lop3.b32 t, u, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 d, t, one, $12; mov.b32 {$6, $7}, d; }""",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
                [word, (zw & m) | -0x3CFF3D00, ((zw >> 4) & m) | -0x3CFF3D00, ((zw >> 8) & m) | -0x3CFF3D00,
                 ((zw >> 12) & m) | -0x3CFF3D00], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            z0, z1, z2, z3 = _h2_zeros(zw)
            c = tl.inline_asm_elementwise(
                """{ .reg .b32 t, d, u, c16;
                mov.b32 c16, 0x2C002C00;
                lop3.b32 t, $8, 0x000F000F, 0x64006400, 0xEA; sub.f16x2 d, t, $9; mov.b32 {$0, $1}, d;
                lop3.b32 t, $8, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 d, t, c16, $10; mov.b32 {$2, $3}, d;
                shr.u32 u, $8, 8;
                lop3.b32 t, u, 0x000F000F, 0x64006400, 0xEA; sub.f16x2 d, t, $11; mov.b32 {$4, $5}, d;
                lop3.b32 t, u, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 d, t, c16, $12; mov.b32 {$6, $7}, d; }""",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [word, z0, z1, z2, z3], dtype=(tl.float16,) * 8, is_pure=True,
                pack=1)
    else:  # column j of each word is field (0, 4, 1, 5, 2, 6, 3, 7)[j]
        dt = tl.bfloat16 if BF16 else tl.float16
        c = tuple((((word >> (4 * f)) & 15) - ((zw >> (4 * f)) & 15)).to(dt) for f in (0, 4, 1, 5, 2, 6, 3, 7))
    # the word's 8 halves as its columns 4 a + 2 b + e: join appends its axis last, so the outermost join picks e
    d = tl.join(tl.join(tl.join(c[0], c[4]), tl.join(c[2], c[6])), tl.join(tl.join(c[1], c[5]), tl.join(c[3], c[7])))
    return tl.reshape(d, (BLOCK_K, BLOCK_N))


@triton.jit(do_not_specialize=["M"])  # the row count changes every step: no variant per "M % 16 == 0"
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, res_ptr, lock_ptr, M, N, K, group_size, k_per_split,
                  n_split, stride_xm, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_om, stride_osplit,
                  stride_rm, FIXUP: tl.constexpr, LAYOUT: tl.constexpr,
                  BITS: tl.constexpr, HAS_G_IDX: tl.constexpr, FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr = False,
                  ASM: tl.constexpr = False):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        a = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if EXACT:  # AWQ in groups, bf16/fp16 rows: the dot of x with the exact q - z, then the group's scales
            d = _awq_exact_tile(qw_ptr, z_ptr, k0, k_end, pid_n * BLOCK_N, N, group_size, stride_qk, stride_zg,
                                a.dtype == tl.bfloat16, BLOCK_K, BLOCK_N, ASM)
            s = tl.load(s_ptr + (k0 // group_size) * stride_sg + n, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.dot(a, d) * s[None, :]
        else:
            w = _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, k_end, pid_n * BLOCK_N, N, group_size, stride_qk,
                              stride_qn, stride_sg, stride_sn, stride_zg, LAYOUT, BITS, HAS_G_IDX, BLOCK_K, BLOCK_N)
            if FP32:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w.to(a.dtype))
    out = out_ptr + pid_k.to(tl.int64) * stride_osplit + m[:, None] * stride_om + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if FIXUP:  # the last program of this output tile to finish sums the split partials, in split order
        tl.debug_barrier()  # every thread's partial is stored before the count
        tile = pid_m * tl.num_programs(1) + pid_n
        done = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == n_split - 1:
            part = out_ptr + m[:, None] * stride_om + n[None, :]
            tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i0 in range(0, n_split, 4):  # 4 loads in flight at once, then added in order
                for j in tl.static_range(4):
                    tot += tl.load(part + (i0 + j) * stride_osplit, mask=mask & (i0 + j < n_split), other=0.0,
                                   cache_modifier=".cg")
            tl.store(res_ptr + m[:, None] * stride_rm + n[None, :], tot.to(res_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next call (CUDA-graph replays included)


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size, k_per_split, stride_qk, stride_qn,
                 stride_sg, stride_sn, stride_zg, stride_osplit, LAYOUT: tl.constexpr, BITS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of x (batch-1 decode) times W^T, for the layouts packed along K (gptq [K/PER, N], pack
    [N, K/PER]) with contiguous groups (AWQ has _awq_gemv_kernel). Per K-tile (inside one group):
    y[n] += s[n] * (sum_k x[k] q[k, n] - z[n] sum_k x[k]) in fp32, the codes taken from each word by shifts,
    without forming the dequantized tile."""
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, PER)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kw = k0 // PER + tl.arange(0, BLOCK_K // PER)
        kw_mask = kw * PER < k_end
        x = tl.load(x_ptr + kw[:, None] * PER + j[None, :], mask=kw_mask[:, None], other=0.0).to(tl.float32)
        word = tl.load(qw_ptr + kw[:, None] * stride_qk + n[None, :] * stride_qn,
                       mask=kw_mask[:, None] & n_mask[None, :], other=0)
        q = ((word[:, None, :] >> _field_shifts(BITS, False)[None, :, None]) & MASK).to(tl.float32)
        xq = tl.sum(tl.sum(x[:, :, None] * q, axis=0), axis=0)
        g = k0 // group_size
        sc = tl.load(s_ptr + g * stride_sg + n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
        if LAYOUT == 1:  # gptq's qzeros [groups, N*BITS/32] hold zero - 1
            zw = tl.load(z_ptr + g * stride_zg + n // PER, mask=n_mask, other=0)
            z = (((zw >> ((n % PER) * BITS)) + 1) & MASK).to(tl.float32)
        else:  # pack: symmetric, codes offset by 2^(BITS-1)
            z = float(1 << (BITS - 1))
        acc += sc * (xq - z * tl.sum(tl.sum(x, axis=1), axis=0))
    tl.store(out_ptr + pid_k.to(tl.int64) * stride_osplit + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


# ---- the AWQ batch-1 GEMV in packed fp16 pairs (_awq_gemv_kernel) ----------------------------------------------
# A 32-bit word w holds 8 codes; lop3(w, 0x000F000F, 0x6400_6400) makes the fp16 pair (1024 + q, 1024 + q') of
# its fields 0 and 4 (columns 0 and 1), lop3(w, 0x00F000F0, ...) the pair (1024 + 16 q, ...) of fields 1 and 5
# (columns 2 and 3), and the same on w >> 8 for columns 4..7: one sub / fma turns each pair into (q - z) exactly,
# one fma.f16x2 adds x (q - z) to two columns' sums. Zeros: 0x6400 | z is the fp16 1024 + z, 0xD400 | 16 z is
# -(64 + z) (-0x2BFF2C00 is 0xD400D400 as an int32); 0x2C00 is 1/16.


@triton.jit
def _h2_x(x, ASM: tl.constexpr):
    """fp32 x -> int32 holding the fp16 pair (x, x)."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $1;", "=r,r", [x], dtype=tl.int32,
                                         is_pure=True, pack=1)
    h = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return h | (h << 16)


@triton.jit
def _h2_half(v, HI: tl.constexpr):
    """One fp16 of the int32-held pair v, as fp32 (the interpreter's path)."""
    if HI:
        v = v >> 16
    return v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_fma(acc, x, d, ASM: tl.constexpr):
    """The fp16 pairs acc + x d (d: a pair of codes minus zeros from _h2_codes), fma.rn.f16x2. The interpreter's
    path rounds each half to fp16 as the instruction does (x d is exact in fp32; its sum with acc is too unless they
    are 2^8 apart in magnitude, when the fp32 rounding can, rarely, move a tie)."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [x, d, acc], dtype=tl.int32,
                                         is_pure=True, pack=1)
    lo = _h2_half(acc, False) + _h2_half(x, False) * _h2_half(d, False)
    hi = _h2_half(acc, True) + _h2_half(x, True) * _h2_half(d, True)
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo16 | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _h2_diff(q, z):
    """The fp16 pair (q - z) of two int32 pairs of small integers (the interpreter's path)."""
    lo = ((q & 0xFFFF) - (z & 0xFFFF)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | (((q >> 16) - (z >> 16)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _h2_codes(w, z0, z1, z2, z3, ASM: tl.constexpr):
    """A word's 8 codes minus their zeros as 4 fp16 pairs, columns (0, 1), (2, 3), (4, 5), (6, 7). z0, z2: the pairs
    1024 + z of columns (0, 1) and (4, 5); z1, z3: -(64 + z) of columns (2, 3) and (6, 7) (see _h2_zeros)."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{ .reg .b32 t, w8, c16;
            mov.b32 c16, 0x2C002C00;
            lop3.b32 t, $4, 0x000F000F, 0x64006400, 0xEA;
            sub.f16x2 $0, t, $5;
            lop3.b32 t, $4, 0x00F000F0, 0x64006400, 0xEA;
            fma.rn.f16x2 $1, t, c16, $6;
            shr.u32 w8, $4, 8;
            lop3.b32 t, w8, 0x000F000F, 0x64006400, 0xEA;
            sub.f16x2 $2, t, $7;
            lop3.b32 t, w8, 0x00F000F0, 0x64006400, 0xEA;
            fma.rn.f16x2 $3, t, c16, $8; }""",
            "=r,=r,=r,=r,r,r,r,r,r", [w, z0, z1, z2, z3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1)
    # the interpreter: the same codes and zeros as small integers (fields as in the asm: 0x000F000F at shifts 0, 8;
    # 0x00F000F0 at 4, 12)
    m = 0x000F000F
    return (_h2_diff(w & m, z0 & m), _h2_diff((w >> 4) & m, (z1 >> 4) & m), _h2_diff((w >> 8) & m, z2 & m),
            _h2_diff((w >> 12) & m, (z3 >> 4) & m))


@triton.jit
def _h2_zeros(zw):
    """The zero operands of _h2_codes from a word of packed zeros (same field order as the codes)."""
    zu = zw >> 8  # arithmetic: only bits 24..31 take the sign, and no mask below keeps them
    return ((zw & 0x000F000F) | 0x64006400, (zw & 0x00F000F0) | -0x2BFF2C00,
            (zu & 0x000F000F) | 0x64006400, (zu & 0x00F000F0) | -0x2BFF2C00)


@triton.jit
def _h2_scaled(acc, s2, lo, hi, ASM: tl.constexpr):
    """lo, hi (fp32) + the fp16 pair of sums acc times the fp16 pair of scales s2, in fp32."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{ .reg .b16 al, ah, sl, sh; .reg .f32 fa, fb;
            mov.b32 {al, ah}, $2; mov.b32 {sl, sh}, $3;
            cvt.f32.f16 fa, al; cvt.f32.f16 fb, sl; fma.rn.f32 $0, fa, fb, $4;
            cvt.f32.f16 fa, ah; cvt.f32.f16 fb, sh; fma.rn.f32 $1, fa, fb, $5; }""",
            "=f,=f,r,r,f,f", [acc, s2, lo, hi], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    return (lo + _h2_half(acc, False) * _h2_half(s2, False), hi + _h2_half(acc, True) * _h2_half(s2, True))


@triton.jit
def _awq_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, part_ptr, out_ptr, lock_ptr, M, N, K, group_size, k_per_split,
                      n_split, stride_xm, stride_qk, stride_sg, stride_zg, stride_psplit, DIRECT: tl.constexpr,
                      FIXUP: tl.constexpr, EVEN: tl.constexpr, MB: tl.constexpr, BLOCK_W: tl.constexpr,
                      BLOCK_K: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr, FIXUP_UNROLL: tl.constexpr,
                      ASM: tl.constexpr, PDL: tl.constexpr):
    """M <= MB rows of x times the AutoAWQ 4-bit layout (qweight [K, N/8]), in packed fp16 arithmetic: each word's
    codes become 4 fp16 pairs of (q - z) once (_h2_codes, 9 instructions for 8 codes), and one fma.f16x2 per pair
    and row adds x (q - z) to two columns' sums. A program holds BLOCK_W words of columns for one K-split; each
    K-tile is BLOCK_K loads of ROWS rows; after a tile each fp16 sum (BLOCK_K terms) is multiplied by its group's
    scale into fp32. Each row of x is first scaled by a power of two that puts its max |x| in this split below 2^8,
    so no fp16 sum can overflow (|sum| <= 16 * 15 * 2^8 < 65504), and the scale is undone in fp32. Split partials
    go to part_ptr [n_split, M, N] fp32; with FIXUP the last program of each column block to finish (an atomic
    count in lock_ptr, reset to 0 after) sums them in split order into out_ptr ([M, N]), so the call is one
    deterministic kernel. DIRECT: a single split writes out_ptr itself. EVEN: BLOCK_W divides N/8 and K is whole
    tiles (no masks on the main loads). s_ptr: the fp16 scales read as int32 pairs of columns. ASM: the fp16-pair
    PTX (not under the interpreter or on ROCm, which run the same arithmetic in the _h2_* emulation). PDL: see
    triton_ops.pdl_enter."""
    tl.static_assert(BLOCK_K <= 16)  # the overflow bound above
    pdl_enter(PDL)
    pid_w, pid_k = tl.program_id(0), tl.program_id(1)
    nw = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    w_mask = nw < N // 8
    m = tl.arange(0, MB)[:, None]  # [MB, 1]
    m_mask = m < M
    mr = m[:, :, None]  # [MB, 1, 1]
    row = tl.arange(0, ROWS)[None, :, None]  # [1, ROWS, 1]: load r of a tile takes rows r * ROWS + row
    TILE: tl.constexpr = BLOCK_K * ROWS
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # per row, the power of two 2^t that puts max |x| of this split below 2^8 (t from max |x|'s exponent field E:
    # t = 134 - E)
    xm = tl.zeros((MB, 512), dtype=tl.float32)
    for k0 in range(k_start, k_end, 512):
        kk = k0 + tl.arange(0, 512)[None, :]
        xv = tl.load(x_ptr + m * stride_xm + kk, mask=m_mask & (kk < k_end), other=0.0)
        xm = tl.maximum(xm, tl.abs(xv.to(tl.float32)))
    e = (tl.max(xm, axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    t = tl.minimum(tl.maximum(134 - e, -126), 126)
    up = ((t + 127) << 23).to(tl.float32, bitcast=True)[:, None, None]  # [MB, 1, 1]
    down = ((127 - t) << 23).to(tl.float32, bitcast=True)[:, None]  # [MB, 1]
    f0 = tl.zeros((MB, ROWS, BLOCK_W), dtype=tl.float32)
    f1, f2, f3, f4, f5, f6, f7 = f0, f0, f0, f0, f0, f0, f0
    for k0 in tl.range(k_start, k_end, TILE, num_stages=STAGES):
        g = k0 // group_size
        zw = tl.load(z_ptr + g * stride_zg + nw, mask=w_mask, other=0)
        z0, z1, z2, z3 = _h2_zeros(zw[None, None, :])
        a0 = tl.zeros((MB, ROWS, BLOCK_W), dtype=tl.int32)  # fp16 pairs, 0.0
        a1, a2, a3 = a0, a0, a0
        for r in tl.static_range(BLOCK_K):
            k = k0 + r * ROWS + row
            if EVEN:
                w = tl.load(qw_ptr + k * stride_qk + nw[None, None, :])
                xv = tl.load(x_ptr + mr * stride_xm + k, mask=mr < M, other=0.0)
            else:
                w = tl.load(qw_ptr + k * stride_qk + nw[None, None, :], mask=(k < k_end) & w_mask[None, None, :],
                            other=0)
                xv = tl.load(x_ptr + mr * stride_xm + k, mask=(mr < M) & (k < k_end), other=0.0)
            x2 = tl.broadcast_to(_h2_x(xv.to(tl.float32) * up, ASM), (MB, ROWS, BLOCK_W))
            d0, d1, d2, d3 = _h2_codes(w, z0, z1, z2, z3, ASM)
            a0 = _h2_fma(a0, x2, tl.broadcast_to(d0, (MB, ROWS, BLOCK_W)), ASM)
            a1 = _h2_fma(a1, x2, tl.broadcast_to(d1, (MB, ROWS, BLOCK_W)), ASM)
            a2 = _h2_fma(a2, x2, tl.broadcast_to(d2, (MB, ROWS, BLOCK_W)), ASM)
            a3 = _h2_fma(a3, x2, tl.broadcast_to(d3, (MB, ROWS, BLOCK_W)), ASM)
        srow = s_ptr + g * stride_sg + nw * 4
        f0, f1 = _h2_scaled(a0, tl.load(srow + 0, mask=w_mask, other=0)[None, None, :], f0, f1, ASM)
        f2, f3 = _h2_scaled(a1, tl.load(srow + 1, mask=w_mask, other=0)[None, None, :], f2, f3, ASM)
        f4, f5 = _h2_scaled(a2, tl.load(srow + 2, mask=w_mask, other=0)[None, None, :], f4, f5, ASM)
        f6, f7 = _h2_scaled(a3, tl.load(srow + 3, mask=w_mask, other=0)[None, None, :], f6, f7, ASM)
    n = m * N + nw[None, :] * 8  # [MB, BLOCK_W]: column 0 of each word, in row m
    o_mask = m_mask & w_mask[None, :]
    if DIRECT:  # one split: straight into the output
        dst = out_ptr + n
    else:
        dst = part_ptr + pid_k.to(tl.int64) * stride_psplit + n
    ty = dst.dtype.element_ty
    tl.store(dst + 0, (tl.sum(f0, axis=1) * down).to(ty), mask=o_mask)
    tl.store(dst + 1, (tl.sum(f1, axis=1) * down).to(ty), mask=o_mask)
    tl.store(dst + 2, (tl.sum(f2, axis=1) * down).to(ty), mask=o_mask)
    tl.store(dst + 3, (tl.sum(f3, axis=1) * down).to(ty), mask=o_mask)
    tl.store(dst + 4, (tl.sum(f4, axis=1) * down).to(ty), mask=o_mask)
    tl.store(dst + 5, (tl.sum(f5, axis=1) * down).to(ty), mask=o_mask)
    tl.store(dst + 6, (tl.sum(f6, axis=1) * down).to(ty), mask=o_mask)
    tl.store(dst + 7, (tl.sum(f7, axis=1) * down).to(ty), mask=o_mask)
    if FIXUP and not DIRECT:
        tl.debug_barrier()  # every thread's partial is stored before the count
        done = tl.atomic_add(lock_ptr + pid_w, 1, sem="acq_rel", scope="gpu")
        if done == n_split - 1:  # the last program of this column block: sum the partials in split order
            c = n[:, :, None] + tl.arange(0, 8)[None, None, :]  # [MB, BLOCK_W, 8]
            c_mask = o_mask[:, :, None]
            tot = tl.zeros((MB, BLOCK_W, 8), dtype=tl.float32)
            for i0 in range(0, n_split, FIXUP_UNROLL):  # FIXUP_UNROLL loads in flight at once, then added in order
                for j in tl.static_range(FIXUP_UNROLL):
                    tot += tl.load(part_ptr + (i0 + j) * stride_psplit + c, mask=c_mask & (i0 + j < n_split),
                                   other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + c, tot.to(out_ptr.dtype.element_ty), mask=c_mask)
            tl.atomic_xchg(lock_ptr + pid_w, 0)  # ready for the next call (CUDA-graph replays included)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, group_size, stride_qk, stride_qn, stride_sg,
                    stride_sn, stride_zg, stride_on, LAYOUT: tl.constexpr, BITS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, n_mask = k < K, n < N
    w = _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, K, tl.program_id(1) * BLOCK_N, N, group_size, stride_qk,
                      stride_qn, stride_sg, stride_sn, stride_zg, LAYOUT, BITS, HAS_G_IDX, BLOCK_K, BLOCK_N)
    out = out_ptr + n[None, :].to(tl.int64) * stride_on + k[:, None]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


@cache
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _shape(qweight, scales, layout, bits) -> tuple[int, int]:
    """(K, N) of the weight."""
    if layout == "awq":
        return qweight.shape[0], scales.shape[1]
    if layout == "gptq":
        return qweight.shape[0] * 32 // bits, scales.shape[1]
    if layout == "pack":
        return qweight.shape[1] * 32 // bits, qweight.shape[0]
    return qweight.shape[1], qweight.shape[0]


def _args(qweight, scales, qzeros, g_idx, layout, bits, group_size, K, block_k):
    """Kernel arguments shared by both kernels, and the K-tile (inside one group unless g_idx is given)."""
    assert layout in _LAYOUT_IDS, layout
    qweight, scales = qweight.contiguous(), scales.contiguous()
    if layout in ("channel", "pack"):  # [N, ...] row-major, scales [N, groups]
        stride_qk, stride_qn, stride_sg, stride_sn = 1, qweight.stride(0), 1, scales.stride(0)
        if layout == "channel":
            group_size, stride_sg = K, 0  # one group
        qzeros = scales  # unused
    else:
        qzeros = qzeros.contiguous()
        stride_qk, stride_qn, stride_sg, stride_sn = qweight.stride(0), 1, scales.stride(0), 1
    if g_idx is None and group_size < K:
        while group_size % block_k and block_k > 16:
            block_k //= 2
        if group_size % block_k:  # groups smaller than any tile: gather per row
            g_idx = torch.arange(K, device=qweight.device, dtype=torch.int32) // group_size
    has_g = g_idx is not None
    g = g_idx.to(torch.int32).contiguous() if has_g else scales
    z_stride = qzeros.stride(0) if layout in ("awq", "gptq") else 0
    return (qweight, scales, qzeros, g, group_size, stride_qk, stride_qn, stride_sg, stride_sn, z_stride, has_g,
            block_k)


def _config(M: int, N: int, K: int, device: torch.device, layout: str = "", gemv_m: int = AWQ_GEMV_M) -> dict:
    """Launch parameters by rows: small M splits K to fill the GPU; larger M uses bigger row tiles."""
    sms = _num_sms(device.index) if device.type == "cuda" else 4
    if M == 1 and layout == "awq":  # _awq_gemv_kernel: the H200's best, cold L2, with programmatic dependent launch
        # (benchmarks/kernels/w4a16.py --grid): wide outputs 512 columns a program and 4 warps, the others 256 and
        # 8 warps, K split in 16 (in 32 for the long K of down_proj); num_stages 1: plain loads, no software pipeline
        if N >= 16384:
            bn, warps, split = 512, 4, 16
        else:
            bn, warps, split = 256, 8, 32 if K > 8192 else 16
        return dict(block_m=1, block_n=bn, block_k=16, split_k=split, num_warps=warps, num_stages=1)
    if layout == "awq" and M <= gemv_m:  # _awq_gemv_kernel for a few rows (benchmarks/kernels/w4a16.py --grid)
        return dict(block_m=1, block_n=256, block_k=16, split_k=16 if K > 8192 else 8, num_warps=8, num_stages=1)
    if layout == "awq" and M <= 16:  # the tile kernel's exact AWQ path: the best of a launch grid at 2-16 rows
        return dict(block_m=16, block_n=128, block_k=128, split_k=8, num_warps=4, num_stages=2)
    if M == 1:  # the GEMV kernel: many K-splits keep enough loads in flight (a launch grid on the H200)
        bn = 256 if N >= 16384 else 128
        bk, split = 32 if bn == 256 else 128, 1
        while split < 16 and K // (bk * split * 2) >= 2:
            split *= 2
        return dict(block_m=1, block_n=bn, block_k=bk, split_k=split, num_warps=2, num_stages=2)
    if M <= 16:
        bn, bk = 64, 128
        tiles = triton.cdiv(N, bn)
        split = 1
        while tiles * split < 2 * sms and K // (bk * split * 2) >= 2:  # keep >= 2 K-tiles per split
            split *= 2
        return dict(block_m=16, block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=4)
    if M <= 64:
        bm = 32 if M <= 32 else 64
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, 128)
        split = 2 if tiles < sms and K >= 2048 else 1
        return dict(block_m=bm, block_n=128, block_k=64, split_k=split, num_warps=4, num_stages=4)
    bm = 64 if M <= 128 else 128
    return dict(block_m=bm, block_n=128, block_k=64, split_k=1, num_warps=8 if bm == 128 else 4, num_stages=3)


def _awq_gemv(x, qw, s, z, out, N, K, group_size, cfg, fixup, fixup_unroll):
    """Launch _awq_gemv_kernel for the rows of x [M, K] (M <= AWQ_GEMV_ROWS): block_n columns (8 per word) per
    program, block_k loads of num_warps rows per K-tile; K split into whole groups, or into whole tiles inside a
    group."""
    M = x.shape[0]
    bw, rows, bk = max(1, cfg["block_n"] // 8), cfg["num_warps"], min(16, cfg["block_k"])
    while group_size % (bk * rows) and bk > 1:
        bk //= 2
    while group_size % (bk * rows):
        rows //= 2
    tile = bk * rows
    split = max(1, min(cfg["split_k"], K // tile))
    kps = triton.cdiv(K, split)
    if kps >= group_size:  # whole groups
        kps = triton.cdiv(kps, group_size) * group_size
    else:  # a divisor of the group that is whole tiles
        kps = max(tile, kps // tile * tile)
        while group_size % kps:
            kps -= tile
    split = triton.cdiv(K, kps)
    dev = x.device
    direct = split == 1
    grid = (triton.cdiv(N // 8, bw), split)
    counts = arrival_counts(dev, grid[0]) if fixup and not direct else None  # per column block
    use_fixup = counts is not None
    part = out if direct else torch.empty(split, M, N, dtype=torch.float32, device=dev)
    s2 = s.view(torch.int32)  # fp16 scales as pairs of columns
    _awq_gemv_kernel[grid](x, qw, s2, z, part, out, counts if use_fixup else part, M, N, K, group_size, kps, split,
                            x.stride(0), qw.stride(0), s2.stride(0), z.stride(0), part.stride(0) if not direct else 0,
                            DIRECT=direct, FIXUP=use_fixup, EVEN=(N // 8) % bw == 0 and K % tile == 0,
                            MB=triton.next_power_of_2(M), BLOCK_W=bw, BLOCK_K=bk, ROWS=rows, STAGES=cfg["num_stages"],
                            FIXUP_UNROLL=fixup_unroll, ASM=_ptx(), num_warps=cfg["num_warps"], num_stages=1,
                            **pdl_launch(dev))
    if not direct and not use_fixup:
        torch.sum(part, 0, out=out.view(M, N))
    return out


def dequant_buffer(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """numel elements of one buffer per device and dtype that every layer's dequantize + cuBLAS GEMM writes its
    weight into (the GEMMs of a forward run one after another on one stream), kept so that decode steps captured in
    CUDA graphs read and write the same memory on every replay. It grows to the largest weight on the first
    forward pass, which the memory planner's profile step makes (so the plan counts it, as it counted the
    per-call temporary it replaces). A buffer outgrown later (a larger model in the same process) is kept alive,
    as graphs may hold it; a capture that still finds it too small takes a temporary from the graph's pool."""
    key = (device, dtype)
    buf = _DEQUANT_BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.empty(numel, dtype=dtype, device=device)
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _DEQUANT_BUFFERS[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                     g_idx: torch.Tensor | None, layout: str, bits: int, group_size: int, dtype: torch.dtype, *,
                     block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in dtype (as w4a16_ref.dequantize_weight(...).to(dtype)), into out [N, K] when given."""
    K, N = _shape(qweight, scales, layout, bits)
    qw, s, z, g, gs, sqk, sqn, ssg, ssn, szg, has_g, bk = _args(qweight, scales, qzeros, g_idx, layout, bits,
                                                                group_size, K, block_k)
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=qweight.device)
    assert out.shape == (N, K) and out.dtype == dtype and out.stride(1) == 1, (out.shape, out.dtype)
    grid = (triton.cdiv(K, bk), triton.cdiv(N, block_n))
    _dequant_kernel[grid](qw, s, z, g, out, N, K, gs, sqk, sqn, ssg, ssn, szg, out.stride(0),
                          LAYOUT=_LAYOUT_IDS[layout],
                          BITS=bits, HAS_G_IDX=has_g, BLOCK_N=block_n, BLOCK_K=bk, num_warps=num_warps)
    return out


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
               g_idx: torch.Tensor | None, layout: str, bits: int, group_size: int, *, block_m: int | None = None,
               block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None, dequant_m: int | None = None,
               gemv_m: int = AWQ_GEMV_M, exact: bool = AWQ_EXACT, out: torch.Tensor | None = None,
               fixup: bool = True, fixup_unroll: int = AWQ_FIXUP_UNROLL, path: str | None = None,
               scale_a: bool | None = None, wide: bool | None = None) -> torch.Tensor:
    """As w4a16_gemm_ref: x [..., K] -> [..., N] in x's dtype. Keywords override the launch parameters, the rows
    from which the weight is dequantized for cuBLAS (dequant_m; default DEQUANT_M, DEQUANT_M_WIDE for N >= WIDE_N),
    the most AWQ rows that take the GEMV (gemv_m), and whether the tile kernel's AWQ path dots the exact codes
    (exact); out: a contiguous [..., N] buffer to write into; fixup=False: the AWQ GEMV and the tile kernel sum
    their K-split partials in a second kernel instead of in their last program per output block, which loads them
    fixup_unroll at a time (the AWQ GEMV). Without dequant_m and path, the dispatch table (kernels/w4a16_configs.json)
    picks the path for M rows; path forces one ("auto", "fused", "dequant"; for layout "tc": "tc", "dequant").
    Layout "tc" (kernels/w4a16_repack.py; g_idx: act-order's K permutation): the tensor-core kernel with the table's
    launch config, the keywords block_n, block_m, split_k, num_warps, num_stages, scale_a, wide overriding it."""
    if layout == "tc":
        launch = dict(block_n=block_n, block_m=block_m, split_k=split_k, num_warps=num_warps, num_stages=num_stages,
                      scale_a=scale_a, wide=wide)
        return _tc(x, qweight, scales, qzeros, g_idx, group_size, out, path, dequant_m, fixup,
                   {k: v for k, v in launch.items() if v is not None})
    K, N = _shape(qweight, scales, layout, bits)
    assert x.shape[-1] == K, (x.shape, K)
    x2, M, out = _rows_and_out(x, K, N, out)
    if M == 0:
        return out
    if dequant_m is None and path is None and bits == 4 and layout != "channel":
        path, table_launch = w4a16_dispatch.choose(x.device, N, K, M)
        block_m, block_n, block_k, split_k, num_warps, num_stages = (
            given if given is not None else table_launch.get(name) for name, given in (  # scale_a: tc only
                ("block_m", block_m), ("block_n", block_n), ("block_k", block_k), ("split_k", split_k),
                ("num_warps", num_warps), ("num_stages", num_stages)))
    if dequant_m is None:
        dequant_m = _FORCED.get(path, DEQUANT_M_WIDE if N >= WIDE_N else DEQUANT_M)
    if M >= dequant_m:
        w = w4a16_dequantize(qweight, scales, qzeros, g_idx, layout, bits, group_size, x.dtype,
                             out=dequant_buffer(x.device, x.dtype, N * K).view(N, K))
        torch.matmul(x2, w.t(), out=out.view(M, N))
        return out
    # _awq_gemv_kernel sums x (q - z) in fp16: fine for bf16 and fp16 rows (about as precise as a GEMM on the weight
    # dequantized to fp16), not for fp32 ones, which take the other kernels (and their launch parameters); AWQ's
    # scales are fp16 (the kernel reads them as pairs)
    awq16 = layout == "awq" and bits == 4 and x.dtype != torch.float32 and scales.dtype == torch.float16
    cfg = _config(M, N, K, x.device, layout if awq16 else "", gemv_m)
    given = dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                 num_stages=num_stages)
    cfg.update({k: v for k, v in given.items() if v is not None})
    qw, s, z, g, gs, sqk, sqn, ssg, ssn, szg, has_g, bk = _args(qweight, scales, qzeros, g_idx, layout, bits,
                                                                group_size, K, cfg["block_k"])
    if awq16 and M <= gemv_m and cfg["block_m"] == 1 and not has_g:  # launches of <= AWQ_GEMV_ROWS rows, even
        rows = triton.cdiv(M, triton.cdiv(M, AWQ_GEMV_ROWS))
        o2 = out.view(M, N)
        for i in range(0, M, rows):
            _awq_gemv(x2[i:i + rows], qw, s, z, o2[i:i + rows], N, K, gs, cfg, fixup, fixup_unroll)
        return out
    gemv = cfg["block_m"] == 1 and M == 1 and layout in ("gptq", "pack") and not has_g
    split = max(1, min(cfg["split_k"], triton.cdiv(K, bk)))
    k_per_split = triton.cdiv(triton.cdiv(K, bk), split) * bk  # a multiple of the tile: splits stay in one group
    split = triton.cdiv(K, k_per_split)
    dst = out.view(M, N) if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    if gemv:
        grid = (triton.cdiv(N, cfg["block_n"]), split)
        _gemv_kernel[grid](x2, qw, s, z, dst, N, K, gs, k_per_split, sqk, sqn, ssg, ssn, szg,
                           dst.stride(0) if split > 1 else 0, LAYOUT=_LAYOUT_IDS[layout], BITS=bits,
                           BLOCK_N=cfg["block_n"], BLOCK_K=bk, num_warps=cfg["num_warps"],
                           num_stages=cfg["num_stages"])
    else:
        block_m = max(16, cfg["block_m"])  # the dot needs 16 rows (a one-row launch without a GEMV path)
        # AWQ with contiguous groups and 16-bit rows: dot with the exact codes minus zeros, scales after it
        exact = layout == "awq" and bits == 4 and not has_g and x.dtype != torch.float32 and exact
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, cfg["block_n"]), split)
        # split partials summed by the last program of each output tile (fixup) or by a second kernel
        counts = arrival_counts(x.device, grid[0] * grid[1]) if fixup and split > 1 else None
        o2 = out.view(M, N)
        _w4a16_kernel[grid](x2, qw, s, z, g, dst, o2, dst if counts is None else counts, M, N, K, gs, k_per_split,
                            split, x2.stride(0), sqk, sqn, ssg, ssn, szg, dst.stride(-2),
                            dst.stride(0) if split > 1 else 0, o2.stride(0), FIXUP=counts is not None,
                            LAYOUT=_LAYOUT_IDS[layout], BITS=bits, HAS_G_IDX=has_g, FP32=x.dtype == torch.float32,
                            BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=bk, EXACT=exact, ASM=exact and _ptx(),
                            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if counts is not None:
            return out
    if split > 1:
        torch.sum(dst, 0, out=out.view(M, N))  # the partials in a fixed order: deterministic
    return out


def _rows_and_out(x: torch.Tensor, K: int, N: int, out: torch.Tensor | None
                  ) -> tuple[torch.Tensor, int, torch.Tensor]:
    """x as [M, K] rows with unit stride, M, and the [..., N] output (out, checked, or a new one)."""
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    assert out.shape == (*x.shape[:-1], N) and out.is_contiguous() and out.dtype == x.dtype, (out.shape, out.dtype)
    return x2, x2.shape[0], out


def _tc(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
        perm: torch.Tensor | None, group_size: int, out: torch.Tensor | None, path: str | None, dequant_m: int | None,
        fixup: bool, launch: dict) -> torch.Tensor:
    """w4a16_gemm on the tc layout: the table's path and launch for M rows (keywords given win), the tensor-core
    kernel or the weight dequantized into the shared buffer (in the repacked K order: act-order's x goes through perm)
    and cuBLAS."""
    N, K = qweight.shape[0], x.shape[-1]
    assert qweight.shape[1] * 8 - 128 < K <= qweight.shape[1] * 8, (x.shape, qweight.shape)
    x2, M, out = _rows_and_out(x, K, N, out)
    if M == 0:
        return out
    table_path, table_launch = w4a16_dispatch.choose_tc(x.device, N, K, M)
    if path is None:
        path = "dequant" if dequant_m is not None and M >= dequant_m else table_path
    o2 = out.view(M, N)
    if path == "dequant":
        w = triton_w4a16_tc.tc_dequantize(qweight, scales, qzeros, group_size, K, x.dtype,
                                          out=dequant_buffer(x.device, x.dtype, N * K).view(N, K))
        torch.matmul(x2 if perm is None else x2.index_select(1, perm), w.t(), out=o2)
        return out
    assert path == "tc", path
    cfg = triton_w4a16_tc.tc_default_config(M, N, K, _num_sms(x.device.index) if x.device.type == "cuda" else 4)
    cfg.update(table_launch)
    cfg.update(launch)
    triton_w4a16_tc.tc_gemm(x2, qweight, scales, qzeros, perm, group_size, o2, fixup=fixup, **cfg)
    return out
