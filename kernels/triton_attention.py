"""Triton paged attention: KV store, split-KV decode (flash-decoding) and varlen causal prefill over the cache.

Each public function has the signature and semantics of its reference in kernels/paged_attention.py, plus
keyword-only launch overrides (for benchmarking) and ``out=`` (a buffer to write the result into). No call
syncs with the host: grids depend only on tensor shapes (block_tables' width, the number of query rows and
sequences), so the calls can be captured in CUDA graphs. Cache layout [num_blocks, block_size, kvh, d];
any power-of-two block size; head dims that are not powers of two are padded with masks. Sliding-window layers
(window=) read only the tiles inside each query's window (the blocks before it may have been freed); softcap=
caps the scores with tanh (Gemma 2).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from vserve.kernels.triton_ops import (
    _ptx,
    _rope_row,
    _rotate_heads,
    _rotated_halves,
    arrival_counts,
    pdl_enter,
    pdl_launch,
    round_to_e4m3,
)

_LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the window a full-attention layer passes: longer than any context
SMALL_SPLITS = 128  # batch x kv heads < 64: partitions of 64-256 tokens, about this many over the table's width


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4, (k_cache.shape, v_cache.shape)
    for c in (k_cache, v_cache):
        # a token's slot is block_id * block_size + offset, so the tokens of a block must be evenly strided
        assert c.stride(-1) == 1 and c.stride(0) == c.shape[1] * c.stride(1), c.stride()
    assert k_cache.shape[1] & (k_cache.shape[1] - 1) == 0, f"block size must be a power of two, got {k_cache.shape[1]}"


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # the latter is ignored for fp16/bf16 operands


@triton.jit
def _e4m3_to_f16(x):
    """e4m3 -> fp16 (exact) by the hardware's paired conversion, as an opaque op: Triton moves a plain cast past the
    layout change into the dot operand, and an fp8 V tile read transposed from shared memory takes one byte load
    per value (128 LDS.U8 a 128-token tile); converted here, V goes through shared memory as fp16 and ldmatrix.trans."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _load_kv(ptrs, mask, dtype, HW_CVT: tl.constexpr = False):
    """Cached K or V in the dtype of the dots (an fp8 cache is upcast here; zero where masked). HW_CVT: an fp8
    cache read for fp16 dots, converted in registers by _e4m3_to_f16 (PTX: not under the interpreter or on ROCm)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if HW_CVT:
        return _e4m3_to_f16(x)
    return x.to(dtype)


@triton.jit
def _scores(qk, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain from the raw dots. SOFTCAP: qk_scale is the plain scale, and the scores are
    softcap * tanh(qk * scale / softcap) (tanh from exp: saturates to +-1 without overflow trouble)."""
    if SOFTCAP:
        x = qk * (qk_scale / softcap)
        return (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (softcap * 1.4426950408889634)
    return qk * qk_scale


def _score_args(scale: float, window: int | None, softcap: float | None) -> tuple[float, int, float]:
    """The kernels' (qk_scale, window, softcap) arguments: the scale in the log2 domain unless soft-capped."""
    assert window is None or window >= 1, window
    return (scale if softcap else scale * _LOG2E, NO_WINDOW if window is None else window, float(softcap or 0.0))


# ---------------------------------------------------------------------------------------------------- store


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_kct, stride_kch, stride_vct, stride_vch, KVH, D, FP8: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < KVH) & (d < D) & (slot >= 0)  # slot -1 marks a padding token
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:  # an fp8 e4m3 cache: round to its grid (saturating), as the reference's clamp + cast
        k, v = round_to_e4m3(k.to(tl.float32)), round_to_e4m3(v.to(tl.float32))
    tl.store(kc_ptr + slot * stride_kct + h * stride_kch + d, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * stride_vct + h * stride_vch + d, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, *, num_warps: int = 4) -> None:
    """Write k/v [T, kvh, d] into their slots; slot -1 (padding) is skipped."""
    T, kvh, d = k.shape
    _check_cache(k_cache, v_cache)
    if T == 0:
        return
    k, v = _unit_last(k), _unit_last(v)
    _store_kvcache_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping.contiguous(), k.stride(0), k.stride(1),
                                v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1),
                                v_cache.stride(2), kvh, d, FP8=k_cache.dtype == torch.float8_e4m3fn,
                                BLOCK_H=triton.next_power_of_2(kvh),
                                BLOCK_D=triton.next_power_of_2(d), num_warps=num_warps, **pdl_launch(k.device))


@triton.jit
def _rope_store_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
                       stride_kct, stride_kch, stride_vct, stride_vch, stride_cos, stride_sin, H, KVH, half,
                       D: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One token: its q heads rotated into qo; its k heads rotated, rounded to k's dtype (as the separate rotary
    kernel's output) and then to the cache's, and its v heads, written into its slot (-1: padding, not written)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    c, s = _rope_row(pos_ptr + t, cos_ptr, sin_ptr, stride_cos, stride_sin, half, BLOCK_HALF)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, H, half, c, s, BLOCK_H,
                  BLOCK_HALF)
    h = tl.arange(0, BLOCK_KVH)[:, None]
    kmask = (h < KVH) & (j < half) & (slot >= 0)
    r1, r2 = _rotated_halves(k_ptr + t * stride_kt, stride_kh, kmask, half, c, s, BLOCK_KVH, BLOCK_HALF)
    k_dtype = k_ptr.dtype.element_ty
    r1, r2 = r1.to(k_dtype), r2.to(k_dtype)
    d = tl.arange(0, BLOCK_D)[None, :]
    vmask = (h < KVH) & (d < D) & (slot >= 0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=vmask)
    if FP8:
        r1, r2 = round_to_e4m3(r1.to(tl.float32)), round_to_e4m3(r2.to(tl.float32))
        v = round_to_e4m3(v.to(tl.float32))
    kc_row = kc_ptr + slot * stride_kct + h * stride_kch
    cache_dtype = kc_ptr.dtype.element_ty
    tl.store(kc_row + j, r1.to(cache_dtype), mask=kmask)
    tl.store(kc_row + half + j, r2.to(cache_dtype), mask=kmask)
    tl.store(vc_ptr + slot * stride_vct + h * stride_vch + d, v.to(vc_ptr.dtype.element_ty), mask=vmask)


def rope_store_kvcache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, *, num_warps: int = 4) -> torch.Tensor:
    """As rope_store_kvcache_ref: rotary_embedding of q and k and store_kvcache of the rotated k and v in one
    launch (the rotated k is never written to memory but in the cache). q/k/v may be views of the packed qkv
    projection (unit last stride). Returns the rotated q."""
    T, H, d = q.shape
    kvh = k.shape[1]
    half = d // 2
    assert k.shape == v.shape == (T, kvh, d) and d % 2 == 0 and cos.shape[-1] == half and sin.shape[-1] == half, \
        (q.shape, k.shape, v.shape, cos.shape)
    _check_cache(k_cache, v_cache)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    cos, sin = _unit_last(cos), _unit_last(sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    _rope_store_kernel[(T,)](positions.contiguous(), q, k, v, cos, sin, q_out, k_cache, v_cache,
                             slot_mapping.contiguous(), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1), k_cache.stride(1),
                             k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), cos.stride(0), sin.stride(0),
                             H, kvh, half, D=d, FP8=k_cache.dtype == torch.float8_e4m3fn,
                             BLOCK_H=triton.next_power_of_2(H), BLOCK_KVH=triton.next_power_of_2(kvh),
                             BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(d),
                             num_warps=num_warps, **pdl_launch(q.device))
    return q_out


# ---------------------------------------------------------------------------------------------------- decode


@triton.jit
def _combine_partials(acc_ptr, m_ptr, l_ptr, out_ptr, n_valid, row0, stride_oh, NUM_SPLITS, D: tl.constexpr,
                      GROUP: tl.constexpr, GROUP_C: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """The GROUP heads from partial row row0 (of [sequence, head]) of one kv head: out = sum_s 2^(m_s - M) acc_s /
    sum_s 2^(m_s - M) l_s over their first n_valid partitions (zeros for none). CHUNK partitions at a time, in one
    pass: a chunk's m, l and acc are loaded together (one round trip to L2 for up to CHUNK partitions, where a loop
    over single partitions waits on each) and folded into running sums rescaled to the running max. The chunks are
    walked by a run-time loop (no constexpr of the partitions' number: eager steps change it, and each value would
    compile again). The partials are read with .cg, past L1, which other SMs' stores do not reach."""
    s = tl.arange(0, CHUNK)
    g = tl.arange(0, GROUP_C)
    gmask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    base = (row0 + g) * NUM_SPLITS  # [GROUP_C]
    big_m = tl.full([GROUP_C], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_C], tl.float32)
    num = tl.zeros([GROUP_C, BLOCK_D], tl.float32)
    for i0 in range(0, n_valid, CHUNK):
        row = base[None, :] + (i0 + s)[:, None]  # [CHUNK, GROUP_C]
        mask = ((i0 + s) < n_valid)[:, None] & gmask[None, :]
        m_c = tl.load(m_ptr + row, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l_c = tl.load(l_ptr + row, mask=mask, other=0.0, cache_modifier=".cg")
        a_c = tl.load(acc_ptr + row[:, :, None] * D + d[None, None, :], mask=mask[:, :, None] & dmask[None, None, :],
                      other=0.0, cache_modifier=".cg")  # [CHUNK, GROUP_C, BLOCK_D]
        new_m = tl.maximum(big_m, tl.max(m_c, axis=0))
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)  # all empty so far (window): weights 0, not NaN
        alpha = tl.exp2(big_m - ref)
        w = tl.exp2(m_c - ref[None, :])  # [CHUNK, GROUP_C]; 0 for an empty or masked partition
        den = den * alpha + tl.sum(l_c * w, axis=0)
        num = num * alpha[:, None] + tl.sum(a_c * w[:, :, None], axis=0)
        big_m = new_m
    o = num / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + g[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])


# Integer arguments that change from step to step are not specialized on (Triton would otherwise compile a
# variant for each of "== 1", "divisible by 16", "other" and stall a step on the compile).
@triton.jit(do_not_specialize=["stride_btb", "NUM_SPLITS", "window"])
def _decode_partition_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, count_ptr,
                             qk_scale, window, softcap, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                             stride_vb, stride_vt, stride_vh, stride_btb, stride_ob, stride_oh, H, NUM_SPLITS,
                             SOFTCAP: tl.constexpr, D: tl.constexpr,
                             GROUP: tl.constexpr, GROUP_P: tl.constexpr, GROUP_C: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             PARTITION: tl.constexpr, CHUNK: tl.constexpr,
                             FUSED_REDUCE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                             F16_DOT: tl.constexpr, V_HW_CVT: tl.constexpr, PDL: tl.constexpr):
    """One (sequence, kv head, partition): all GROUP query heads of the kv head against PARTITION tokens, so each
    KV tile is read once per group. The group is padded to GROUP_P >= 16 rows for tl.dot. FUSED_REDUCE: the last
    partition of a (sequence, kv head) to finish (an atomic arrival count) combines the partitions' partials, so
    no reduce kernel is launched. PDL: see triton_ops.pdl_enter. A partition wholly before the sliding window reads
    nothing and leaves empty partials (m = -inf, l = 0), which the combine weighs zero."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = split * PARTITION
    if split > 0 and start >= ctx:
        return  # past the sequence's end: the combine reads only the partitions that hold tokens
    end = tl.minimum(start + PARTITION, ctx)

    g = tl.arange(0, GROUP_P)
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if F16_DOT:  # bf16 queries over an fp8 cache: the dots in fp16 (e4m3 -> fp16 is one conversion per pair)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    for n0 in range(tl.maximum(start, ctx - window), end, BLOCK_N):  # the window's tokens of this partition
        offs = n0 + tl.arange(0, BLOCK_N)
        nmask = offs < end
        blk = tl.load(bt_row + offs // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        tok = offs % BLOCK_SIZE
        k_off = blk * stride_kb + tok * stride_kt + kvh * stride_kh
        kt = _load_kv(kc_ptr + k_off[None, :] + d[:, None], nmask[None, :] & dmask[:, None], q.dtype)
        s = _scores(tl.dot(q, kt, input_precision=DOT_PRECISION), qk_scale, softcap, SOFTCAP)  # [GROUP_P, BLOCK_N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the first tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = blk * stride_vb + tok * stride_vt + kvh * stride_vh
        v = _load_kv(vc_ptr + v_off[:, None] + d[None, :], nmask[:, None] & dmask[None, :], q.dtype, V_HW_CVT)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if ctx <= PARTITION:  # this sequence has one partition (or none: zeros): normalize and write the output here
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty context (a padded row) gives zeros
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=gmask[:, None] & dmask[None, :])
    else:  # partials [B, H, NUM_SPLITS(, D)], combined by the reduce kernel
        row = (b * H + heads) * NUM_SPLITS + split
        tl.store(m_ptr + row, m_i, mask=gmask)
        tl.store(l_ptr + row, l_i, mask=gmask)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
        if FUSED_REDUCE:
            tl.debug_barrier()  # every thread's partials are stored before the count
            count = count_ptr + b * (H // GROUP) + kvh
            n_valid = tl.minimum(tl.cdiv(ctx, PARTITION), NUM_SPLITS)
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == n_valid - 1:  # the last one: combine
                _combine_partials(acc_ptr, m_ptr, l_ptr, out_ptr + b * stride_ob + kvh * GROUP * stride_oh, n_valid,
                                  b * H + kvh * GROUP, stride_oh, NUM_SPLITS, D, GROUP, GROUP_C, BLOCK_D, CHUNK)
                tl.atomic_xchg(count, 0)  # ready for the next launch (CUDA-graph replays included)


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _decode_reduce_kernel(acc_ptr, m_ptr, l_ptr, ctx_ptr, out_ptr, stride_ob, stride_oh, H, NUM_SPLITS,
                          D: tl.constexpr, GROUP: tl.constexpr, GROUP_C: tl.constexpr, BLOCK_D: tl.constexpr,
                          PARTITION: tl.constexpr, CHUNK: tl.constexpr):
    """Combine one (sequence, kv head)'s partitions (fused_reduce=False), as the fused path's last partition does."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    if ctx <= PARTITION and ctx > 0:
        return  # one partition: the partition kernel wrote the output
    _combine_partials(acc_ptr, m_ptr, l_ptr, out_ptr + b * stride_ob + kvh * GROUP * stride_oh,
                      tl.minimum(tl.cdiv(ctx, PARTITION), NUM_SPLITS), b * H + kvh * GROUP, stride_oh, NUM_SPLITS, D,
                      GROUP, GROUP_C, BLOCK_D, CHUNK)


@cache
def _unused_f32(device: torch.device) -> torch.Tensor:
    return torch.empty(16, dtype=torch.float32, device=device)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, softcap: float | None = None, *,
                           partition_size: int | None = None, block_n: int | None = None, num_warps: int = 4,
                           num_stages: int | None = None, maxnreg: int | None = None, fused_reduce: bool = True,
                           combine_chunk: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, H, d] attends to its first context_lens[b] cached tokens (the last window
    of them on a sliding-window layer) -> [B, H, d].

    Split-KV: the context is cut into partitions of partition_size tokens (a multiple of block_n); the number of
    partitions comes from block_tables' width (no host sync), partitions past a sequence's end return at once, a
    sequence that fits one partition is finished by its partition's program, and the partials of the others are
    combined by the last of their partitions to finish (fused_reduce=False: by a second, reduce kernel). A row with
    context_len 0 gives zeros. Defaults (sweeps on an H200, bf16, mixed context lengths, block tables as wide as the
    CUDA graphs capture them; benchmarks/kernels/): when B * kvh < 64, partitions of 64 to 256 tokens, about
    SMALL_SPLITS of them over the table's width (more programs for small batches; 64 tokens for an 8192-token table:
    +2.5% AWQ, +1% bf16 batch-1 decode on the 8B shape against 256; docs/performance.md),
    512 below 512 programs, 2048 from there (a long partition per program when the batch alone
    fills the GPU); KV tiles of 64 tokens, 128 for head dims <= 64 or an fp8 cache; 2 pipeline stages. Over an
    fp8 cache with bf16 queries the dots run in fp16 (benchmarks/fp8_kv_decode.py: e4m3 -> fp16 converts faster
    than e4m3 -> bf16), and V is converted in registers before its layout change (_e4m3_to_f16). The partials are
    combined combine_chunk partitions at a time (a power of two; default: 1 when B * kvh < 64, else 4 for the 8B
    shape, 2048 // (GROUP_C * BLOCK_D): an H100 sweep, benchmarks/data/s39/, found 4 and 8 30-92% slower than 1
    at 1 and 4 sequences, and 4 at 64 sequences 6% faster than 1 or 2).
    """
    B, H, d = q.shape
    _check_cache(k_cache, v_cache)
    _, bs, kvh, _ = k_cache.shape
    assert H % kvh == 0, (H, kvh)
    small_batch = B * kvh < 64
    if partition_size is None:
        small = min(256, max(64, triton.next_power_of_2(triton.cdiv(block_tables.shape[1] * bs, SMALL_SPLITS))))
        partition_size = small if small_batch else 512 if B * kvh < 512 else 2048
    num_stages = num_stages or 2
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    block_n = block_n or min(128 if d <= 64 or fp8 else 64, partition_size)
    assert partition_size % block_n == 0 and block_n >= 16, (partition_size, block_n)
    group = H // kvh
    q, block_tables = _unit_last(q), _unit_last(block_tables)
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    num_splits = max(1, triton.cdiv(block_tables.shape[1] * bs, partition_size))
    single = num_splits == 1
    # One kernel variant for one split and several: eager steps' tables are only as wide as their longest context,
    # and a variant of its own (a constexpr, or another pointer dtype) would compile mid-run (a ~1 s step).
    counts = arrival_counts(q.device, B * kvh) if fused_reduce else None
    if single:
        acc = m = l = _unused_f32(q.device)  # the partials' dtype, as in the several-split variant
    else:
        acc = torch.empty((B, H, num_splits, d), dtype=torch.float32, device=q.device)
        m = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    block_d, group_c = triton.next_power_of_2(d), triton.next_power_of_2(group)
    group_p = max(16, group_c)
    # the combine's chunk: one partition a round of loads for small batches (an H100 sweep found wider rounds slower
    # there), up to 2,048 fp32 values of acc in flight for larger ones (4 partitions for the 8B shape: the fastest
    # at 64 sequences)
    chunk = combine_chunk or (1 if small_batch else max(1, min(16, 2048 // (group_c * block_d))))
    assert chunk & (chunk - 1) == 0, chunk
    _decode_partition_kernel[(B, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, acc, m, l, out if counts is None else counts,
        *_score_args(scale, window, softcap), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), H, num_splits, SOFTCAP=bool(softcap), D=d, GROUP=group, GROUP_P=group_p,
        GROUP_C=group_c, BLOCK_SIZE=bs, BLOCK_N=block_n, BLOCK_D=block_d,
        PARTITION=partition_size, CHUNK=chunk, FUSED_REDUCE=counts is not None,
        DOT_PRECISION=_dot_precision(q.dtype), F16_DOT=q.dtype == torch.bfloat16 and fp8,
        V_HW_CVT=fp8 and q.dtype != torch.float32 and _ptx(),
        num_warps=num_warps, num_stages=num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg}),
        **pdl_launch(q.device))
    if not single and counts is None:
        _decode_reduce_kernel[(B, kvh)](acc, m, l, context_lens, out, out.stride(0), out.stride(1), H, num_splits,
                                        D=d, GROUP=group, GROUP_C=group_c, BLOCK_D=block_d, PARTITION=partition_size,
                                        CHUNK=chunk, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------------- prefill


@triton.jit
def _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles hold program pid: sequence b's tiles start at cu[b] // BLOCK_Q + b."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_tile(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_row, n0, q_pos, kv_lo, kv_end, qk_scale, window, softcap, d,
                  dmask,
                  stride_kb, stride_kt, stride_vb, stride_vt, kv_head_k, kv_head_v, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  V_HW_CVT: tl.constexpr):
    """One KV tile of the online softmax; MASKED applies the causal and sliding-window masks and the context end
    (a row may then see nothing of the tile, or of the tiles so far: its maximum stays -inf and adds nothing), and
    loads nothing outside [kv_lo, kv_end) (blocks before kv_lo may be freed: garbage times a zero weight is nan)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        nmask = (offs < kv_end) & (offs >= kv_lo)
        blk = tl.load(bt_row + offs // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        kmask = nmask[None, :] & dmask[:, None]
        vmask = nmask[:, None] & dmask[None, :]
    else:
        blk = tl.load(bt_row + offs // BLOCK_SIZE).to(tl.int64)
        kmask = dmask[:, None]
        vmask = dmask[None, :]
    tok = offs % BLOCK_SIZE
    kt = _load_kv(kc_ptr + (blk * stride_kb + tok * stride_kt + kv_head_k)[None, :] + d[:, None], kmask, q.dtype)
    s = _scores(tl.dot(q, kt, input_precision=DOT_PRECISION), qk_scale, softcap, SOFTCAP)
    if MASKED:
        seen = (offs[None, :] <= q_pos[:, None]) & (offs[None, :] > q_pos[:, None] - window) & nmask[None, :]
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:  # rows that saw nothing yet: exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = nan
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_kv(vc_ptr + (blk * stride_vb + tok * stride_vt + kv_head_v)[:, None] + d[None, :], vmask, q.dtype,
                 V_HW_CVT)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["cu_ptr", "ctx_ptr", "bt_ptr", "stride_btb", "num_seqs", "window"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, cu_ptr, ctx_ptr, bt_ptr, out_ptr, qk_scale, window, softcap, stride_qt,
                    stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb,
                    stride_ot, stride_oh, num_seqs, SOFTCAP: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, F16_DOT: tl.constexpr, V_HW_CVT: tl.constexpr):
    """One (query tile, kv head): BLOCK_M rows = BLOCK_Q query tokens x the GROUP query heads of the kv head (so
    each KV tile is read once per group), flash-attention over the sequence's cached tokens up to each row's
    position. Tiles every row sees whole (below the first row's position, inside the last row's window) skip the
    masks; tiles before the first row's window are not read."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_ptr + b)
    qlen = tl.load(cu_ptr + b + 1) - q_start
    t0 = (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if t0 < qlen:
        ctx = tl.load(ctx_ptr + b)
        rows = tl.arange(0, BLOCK_M)
        tok = t0 + rows // GROUP
        heads = kvh * GROUP + rows % GROUP
        rmask = (rows < BLOCK_Q * GROUP) & (tok < qlen)
        q_pos = ctx - qlen + tok  # absolute positions: this chunk is the sequence's last qlen tokens
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q_row = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        if F16_DOT:  # as in the decode kernel: bf16 queries over an fp8 cache, dots in fp16
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        first_pos = ctx - qlen + t0
        kv_end = ctx - qlen + tl.minimum(t0 + BLOCK_Q, qlen)  # one past the tile's last query position
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # KV tiles every row of this tile sees up to its position
        kv_lo = tl.maximum(first_pos - window + 1, 0)  # the first token the first row's window holds
        lo = kv_lo // BLOCK_N * BLOCK_N
        # from here on every row's window holds whole tiles (0 without a window)
        win_full = tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N, full_end)
        for n0 in range(lo, win_full, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_row, n0, q_pos, kv_lo, kv_end, qk_scale,
                                          window, softcap, d, dmask, stride_kb, stride_kt, stride_vb, stride_vt,
                                          kvh * stride_kh, kvh * stride_vh, BLOCK_SIZE, BLOCK_N, True, SOFTCAP,
                                          DOT_PRECISION, V_HW_CVT)
        for n0 in range(tl.maximum(win_full, lo), full_end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_row, n0, q_pos, kv_lo, kv_end, qk_scale,
                                          window, softcap, d, dmask, stride_kb, stride_kt, stride_vb, stride_vt,
                                          kvh * stride_kh, kvh * stride_vh, BLOCK_SIZE, BLOCK_N, False, SOFTCAP,
                                          DOT_PRECISION, V_HW_CVT)
        for n0 in range(tl.maximum(full_end, lo), kv_end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_row, n0, q_pos, kv_lo, kv_end, qk_scale,
                                          window, softcap, d, dmask, stride_kb, stride_kt, stride_vb, stride_vt,
                                          kvh * stride_kh, kvh * stride_vh, BLOCK_SIZE, BLOCK_N, True, SOFTCAP,
                                          DOT_PRECISION, V_HW_CVT)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i > 0 on real rows (each sees its own position)
        tl.store(out_ptr + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def prefill_launch_config(head_dim: int, group: int) -> dict:
    """Default tiles for paged_prefill_attention, the best of a sweep on an H200 (bf16, 2x4096 causal): 64
    (token, head) rows x 64 KV positions for d = 128, x 128 for d <= 64; 4 warps, 2 stages."""
    block_d = triton.next_power_of_2(head_dim)
    return dict(block_m=max(64, triton.next_power_of_2(group)), block_n=128 if block_d <= 64 else 64, num_warps=4,
                num_stages=2)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, window: int | None = None, softcap: float | None = None, *,
                            block_m: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen causal attention over the paged cache: sequence b's queries q[cu[b]:cu[b+1]] are its last tokens and
    attend to every cached token up to their own position (cached prefix + this chunk; its last window on a
    sliding-window layer) -> [T, H, d].

    The grid is T // BLOCK_Q + num_seqs programs per kv head (BLOCK_Q = block_m // group query tokens a tile),
    an upper bound on the tiles the sequences need; each program finds its sequence by binary search over
    cu_seqlens_q, and the spare ones exit. cu_seqlens_q[-1] must be <= T.
    """
    T, H, d = q.shape
    _check_cache(k_cache, v_cache)
    _, bs, kvh, _ = k_cache.shape
    assert H % kvh == 0, (H, kvh)
    group = H // kvh
    cfg = prefill_launch_config(d, group)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    assert block_m >= max(16, group) and block_n >= 16, (block_m, block_n, group)
    block_q = block_m // group
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    q, block_tables = _unit_last(q), _unit_last(block_tables)
    out = torch.empty_like(q) if out is None else out
    num_seqs = context_lens.shape[0]
    if T == 0 or num_seqs == 0:
        return out
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _prefill_kernel[(T // block_q + num_seqs, kvh)](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out, *_score_args(scale, window, softcap),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), num_seqs,
        SOFTCAP=bool(softcap), D=d, GROUP=group,
        BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d),
        DOT_PRECISION=_dot_precision(q.dtype), F16_DOT=q.dtype == torch.bfloat16 and fp8,
        V_HW_CVT=fp8 and q.dtype != torch.float32 and _ptx(), num_warps=num_warps, **extra)
    return out

