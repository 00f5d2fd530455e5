"""The tensor-core W4A16 GEMM on the "tc" layout (kernels/w4a16_repack.py): y = x @ W^T for any number of rows.

Marlin's and Machete's ideas, in Triton:
- swapped operands: the kernel computes y^T = W x^T, with a [BLOCK_N, 16] slice of W as the dot's left operand,
  held in registers, and x^T's [16, BLOCK_M] slice as the right one, staged through shared memory by the software
  pipeline (num_stages). Weight rows fill the MMA's 64-row side; tokens take its narrow side (16 and up), so a decode
  batch of 8 wastes no weight bandwidth and little tensor-core work;
- no shared-memory pass for the weights' dequantization: the layout packs each word's 8 codes along K, field j of the
  16 words of a 128-wide K tile being the tile's j-th 16-wide slice, so unpacking field j is elementwise on the loaded
  words and Triton loads the words from shared memory straight into the dot operand's registers (compiled for sm_90a:
  `ttg.local_load ... -> #ttg.dot_op` on the int32 words, then the arithmetic, then `warp_group_dot` with its left
  operand in registers);
- the unpack is a few instructions a register: on NVIDIA GPUs PTX takes two words (two consecutive K values of one
  row, the pair an MMA register holds), gathers one byte of each into one register (prmt), ORs each nibble pair into
  the fp16/bf16 magic number (1024 or 128, lop3) and takes the zero off with one packed fma: 8 exact q - z pairs for
  16 codes (elsewhere, and under the interpreter, the same values in Triton integer ops);
- per-group scales applied in registers, once per group and output, to the dot's fp32 result: the dot sums exact
  products x (q - z); fp16/bf16 scales are read as the int32 words that hold them (a 4-byte load the software
  pipeline prefetches like the zeros; a 2-byte one stayed in the loop, a wait and a barrier every tile);
- one dot a tile (WIDE, groups of 128 and up): the 8 fields joined into a [BLOCK_N, 128] operand; with 4 warps on
  sm_90 that is one chain of wgmma instructions with no full wait inside the loop, where 8 dots of K = 16 wait after
  each (ptxas's `WARPGROUP.DEPBAR.LE gsb0, 0x0`; benchmarks/kernels/triton_sass.py shows both);
- split-K for small M so that a few output tiles still fill the GPU; each split writes an fp32 partial and the last
  program of each output tile to finish sums them in split order (deterministic; one kernel);
- act-order: K was sorted by group at load; the kernel reads x's columns through that permutation (no extra kernel).
No call syncs with the host (CUDA graphs capture decode). Launch configs and the choice of path per row count are
data: kernels/w4a16_configs.json (kernels/w4a16_dispatch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vserve.kernels.triton_ops import _ptx, arrival_counts, pdl_enter, pdl_launch


def _unpack_asm(bf16: bool, scaled: bool) -> str:
    """PTX for two words a ($8), b ($9), their zeros ($10, $11) and, when scaled, their scales as one packed pair
    ($12): outputs $j (j = 0..7) = the pair (field j of a minus its zero, field j of b minus its zero) in bf16 or
    fp16, times the scales when scaled. prmt puts byte k of a in bits 0..7 and byte k of b in bits 16..23; a lop3 ORs
    its low (or, after a shift, high) nibbles into the mantissa of the magic number M (128 in bf16, 1024 in fp16):
    the exact pair M + q; one packed fma with 1.0 adds -(M + z), exactly; scaled, one more (with -0.0) multiplies by
    the scales (one rounding)."""
    magic, one, fma = (0x43004300, 0x3F803F80, "fma.rn.bf16x2") if bf16 else (0x64006400, 0x3C003C00, "fma.rn.f16x2")
    lines = [".reg .b32 p, u, t, d, one, nz, mz;", f"mov.b32 one, {one:#x};", "mov.b32 mz, 0x80008000;",
             "prmt.b32 t, $10, $11, 0x0400;", f"lop3.b32 t, t, 0x000F000F, {magic:#x}, 0xEA;",
             "or.b32 nz, t, 0x80008000;"]  # -(M + z) for both halves
    for k in range(4):
        lines.append(f"prmt.b32 p, $8, $9, {0x0400 + 0x0101 * k:#x};")
        for j, src in ((2 * k, "p"), (2 * k + 1, "u")):
            if src == "u":
                lines.append("shr.b32 u, p, 4;")
            lines.append(f"lop3.b32 t, {src}, 0x000F000F, {magic:#x}, 0xEA;")
            lines += [f"{fma} d, t, one, nz;", f"{fma} ${j}, d, $12, mz;"] if scaled else \
                [f"{fma} ${j}, t, one, nz;"]
    return "{ " + " ".join(lines) + " }"


_ASM_BF16: tl.constexpr = tl.constexpr(_unpack_asm(True, False))
_ASM_F16: tl.constexpr = tl.constexpr(_unpack_asm(False, False))
_ASM_BF16_S: tl.constexpr = tl.constexpr(_unpack_asm(True, True))
_ASM_F16_S: tl.constexpr = tl.constexpr(_unpack_asm(False, True))
_OUT8: tl.constexpr = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,")


@triton.jit
def _tc_codes(w, z, s, DT: tl.constexpr, ASM: tl.constexpr, SCALED: tl.constexpr):
    """The 8 fields of the int32 words w minus the zeros z (int32, broadcast), times the scales s (DT, broadcast)
    when SCALED, as 8 tensors of w's shape in DT (unscaled: the exact small integers q - z). Field j is the j-th
    16-wide K slice of the tile."""
    if ASM and SCALED and DT == tl.bfloat16:
        return tl.inline_asm_elementwise(_ASM_BF16_S, _OUT8 + "r,r,r,r,r", [w, z, s], dtype=(tl.bfloat16,) * 8,
                                         is_pure=True, pack=2)
    if ASM and SCALED and DT == tl.float16:
        return tl.inline_asm_elementwise(_ASM_F16_S, _OUT8 + "r,r,r,r,r", [w, z, s], dtype=(tl.float16,) * 8,
                                         is_pure=True, pack=2)
    if ASM and DT == tl.bfloat16:
        return tl.inline_asm_elementwise(_ASM_BF16, _OUT8 + "r,r,r,r", [w, z], dtype=(tl.bfloat16,) * 8,
                                         is_pure=True, pack=2)
    if ASM and DT == tl.float16:
        return tl.inline_asm_elementwise(_ASM_F16, _OUT8 + "r,r,r,r", [w, z], dtype=(tl.float16,) * 8, is_pure=True,
                                         pack=2)
    c0, c1, c2, c3 = (w & 15) - z, ((w >> 4) & 15) - z, ((w >> 8) & 15) - z, ((w >> 12) & 15) - z
    c4, c5, c6, c7 = ((w >> 16) & 15) - z, ((w >> 20) & 15) - z, ((w >> 24) & 15) - z, ((w >> 28) & 15) - z
    if SCALED:  # rounded once, as the asm's fma
        sf = s.to(tl.float32)
        return (c0 * sf).to(DT), (c1 * sf).to(DT), (c2 * sf).to(DT), (c3 * sf).to(DT), (c4 * sf).to(DT), \
            (c5 * sf).to(DT), (c6 * sf).to(DT), (c7 * sf).to(DT)
    return c0.to(DT), c1.to(DT), c2.to(DT), c3.to(DT), c4.to(DT), c5.to(DT), c6.to(DT), c7.to(DT)


@triton.jit
def _tc_zeros(z_ptr, g, n, n_mask, stride_zg, HAS_ZEROS: tl.constexpr):
    """The zero points [BLOCK_N] (int32) of group g: field n % 8 of word n // 8 (symmetric: 8)."""
    if HAS_ZEROS:
        zw = tl.load(z_ptr + g * stride_zg + n // 8, mask=n_mask, other=0)
        return (zw >> ((n % 8) * 4)) & 15
    return tl.full(n.shape, 8, tl.int32)


@triton.jit
def _tc_scales(s_ptr, g, n, n_mask, stride_sg, S_WORDS: tl.constexpr):
    """The scales [BLOCK_N] of group g, in their dtype. S_WORDS 1 / 2 (fp16 / bf16 scales, N even): s_ptr is the
    scales as int32 words and stride_sg in words; each output reads the word holding its scale and takes its half.
    A 4-byte load is one the software pipeline prefetches into shared memory and reads back in the layout the
    unpack wants; a 2-byte one it leaves in the loop body, where each tile waited on it and changed its layout
    through shared memory behind a barrier (sm_90 SASS: LDG.E.U16, STS.U16, BAR.SYNC, LDS)."""
    if S_WORDS == 0:
        s = tl.load(s_ptr + g * stride_sg + n, mask=n_mask, other=0.0)
    else:
        sw = tl.load(s_ptr + g * stride_sg + n // 2, mask=n_mask, other=0)
        half = (sw >> ((n % 2) * 16)).to(tl.int16)  # little-endian: the even output's scale is the word's low half
        if S_WORDS == 1:
            s = half.to(tl.float16, bitcast=True)
        else:
            s = half.to(tl.bfloat16, bitcast=True)
    return s


@triton.jit
def _tc_x(x_ptr, perm_ptr, k, m, m_mask, stride_xm, K, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):
    """x^T's rows k (x's columns, through act-order's permutation) for the tile's rows m: [len(k), BLOCK_M]."""
    if HAS_PERM and EVEN_K:
        kx = tl.load(perm_ptr + k)
    elif HAS_PERM:
        kx = tl.load(perm_ptr + k, mask=k < K, other=0)
    else:
        kx = k
    if EVEN_K:
        return tl.load(x_ptr + m[None, :] * stride_xm + kx[:, None], mask=m_mask[None, :], other=0.0)
    return tl.load(x_ptr + m[None, :] * stride_xm + kx[:, None], mask=m_mask[None, :] & (k < K)[:, None], other=0.0)


@triton.jit
def _tc_cat(a, b):
    """[R, W] and [R, W] -> [R, 2 W], a's columns first. join puts the pair in a thread's registers; with the fields
    of one word in one thread's registers (the unpack), the result is the dot operand's layout for the wider K with
    no data crossing threads."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit(do_not_specialize=["M"])  # the row count changes every step: one compiled variant per launch config
def _tc_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, tiles_per_split, n_split,
               stride_xm, stride_qn, stride_sg, stride_zg, stride_om, stride_pk, GROUP: tl.constexpr,
               MODE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr,
               SCALE_A: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr,
               PDL: tl.constexpr, WIDE: tl.constexpr = False, S_WORDS: tl.constexpr = 0,
               EVEN_N: tl.constexpr = False):
    """out[m, n] = sum_k x[m, k] W[n, k] for a [BLOCK_N, BLOCK_M] tile of y^T and the 128-wide K tiles of one split.
    GROUP: the group size (a constexpr: no integer division in the loop); a group segment is SEG 16-wide K slices
    (8: groups of 128 or more, one segment a tile; 1, 2, 4: groups of 16, 32, 64). EVEN_K: 128 divides K (no masks
    along K). SCALE_A: the scales multiply the weight operand (q - z) s, rounded once to x's dtype as the reference
    rounds W (one accumulator; cheaper per row for large BLOCK_M), else the dot's fp32 result per group segment (the
    dot sums exact products; a second accumulator). MODE 0: one split, written to out; 1: fp32 partials to part_ptr
    [n_split, M, N], the last program of the output tile (an atomic count in lock_ptr, reset after) sums them in
    split order into out; 2: partials only (the caller sums them). PDL: launched as a programmatic dependent launch
    (triton_ops.pdl_enter: in a batch-1 decode graph the programs are resident when the kernel before ends).
    WIDE (groups of 128 or more): the tile's 8 fields joined into one [BLOCK_N, 128] operand and one dot with K = 128
    (x^T's 128 rows one load): on sm_90 one chain of wgmma instructions and one wait a tile, where 8 dots of K = 16
    wait after each. S_WORDS: how the scales are read (_tc_scales: 0 as stored; 1, 2: fp16, bf16 scales as int32
    words, which the pipeline prefetches). EVEN_N: BLOCK_N divides N, so no load or store is masked along N (on
    sm_90a the 256 x 128 launch's loop lost 29 of 489 instructions and its one spill, the others 2-4%)."""
    pdl_enter(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    SEG: tl.constexpr = 8 if GROUP >= 128 else GROUP // 16
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # row tiles of one weight tile together
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    n_mask = tl.full((BLOCK_N,), 1, tl.int1) if EVEN_N else n < N  # a constant mask: no predicates
    i16 = tl.arange(0, 16)
    t_lo = pid_k * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, tl.cdiv(K, 128))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(t_lo, t_hi):
        w = tl.load(qw_ptr + n[:, None] * stride_qn + (t * 16 + i16)[None, :], mask=n_mask[:, None], other=0)
        if SEG == 8:  # one group in the tile: its zeros (and scales) go into the unpack
            z = _tc_zeros(z_ptr, (t * 128) // GROUP, n, n_mask, stride_zg, HAS_ZEROS)
            s = _tc_scales(s_ptr, (t * 128) // GROUP, n, n_mask, stride_sg, S_WORDS)
            c = _tc_codes(w, z[:, None], s.to(DT)[:, None], DT, ASM, SCALE_A)
        else:  # smaller groups: each slice's zeros (and scales) are applied after it
            c = _tc_codes(w, tl.zeros((BLOCK_N, 1), dtype=tl.int32), 1.0, DT, ASM, False)
        if WIDE and SEG == 8:
            a = _tc_cat(_tc_cat(_tc_cat(c[0], c[1]), _tc_cat(c[2], c[3])),
                        _tc_cat(_tc_cat(c[4], c[5]), _tc_cat(c[6], c[7])))
            xt = _tc_x(x_ptr, perm_ptr, t * 128 + tl.arange(0, 128), m, m_mask, stride_xm, K, HAS_PERM, EVEN_K)
            if SCALE_A:
                acc = tl.dot(a, xt, acc, input_precision="ieee" if DT == tl.float32 else None)
            else:
                sp = _tc_scales(s_ptr, (t * 128) // GROUP, n, n_mask, stride_sg, S_WORDS)
                acc += tl.dot(a, xt, input_precision="ieee" if DT == tl.float32 else None) * \
                    sp.to(tl.float32)[:, None]
        else:
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for j in tl.static_range(8):
                xt = _tc_x(x_ptr, perm_ptr, t * 128 + j * 16 + i16, m, m_mask, stride_xm, K, HAS_PERM, EVEN_K)
                a = c[j]
                if SEG < 8:
                    if j % SEG == 0:
                        g = (t * 128 + j * 16) // GROUP
                        zs = _tc_zeros(z_ptr, g, n, n_mask, stride_zg, HAS_ZEROS).to(DT)[:, None]
                        ss = _tc_scales(s_ptr, g, n, n_mask, stride_sg, S_WORDS).to(tl.float32)[:, None]
                    a = a - zs
                    if SCALE_A:
                        a = (a.to(tl.float32) * ss).to(DT)
                if SCALE_A:
                    acc = tl.dot(a, xt, acc, input_precision="ieee" if DT == tl.float32 else None)
                else:
                    part = tl.dot(a, xt, part, input_precision="ieee" if DT == tl.float32 else None)
                    if (j + 1) % SEG == 0:  # the segment's group: its scales, once per output, on the fp32 sums
                        sp = _tc_scales(s_ptr, (t * 128 + j * 16) // GROUP, n, n_mask, stride_sg, S_WORDS)
                        acc += part * sp.to(tl.float32)[:, None]
                        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    mask = n_mask[:, None] & m_mask[None, :]
    if MODE == 0:
        tl.store(out_ptr + m[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part_at = part_ptr + m[None, :] * N + n[:, None]
        tl.store(part_at + pid_k.to(tl.int64) * stride_pk, acc, mask=mask)
        if MODE == 1:  # the last program of this output tile to finish sums the partials, in split order
            tl.debug_barrier()  # every thread's partial is stored before the count
            tile = pid_n * tl.num_programs(0) + pid_m
            done = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == n_split - 1:
                tot = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for i0 in range(0, n_split, 4):  # 4 loads in flight at once, then added in order
                    for jj in tl.static_range(4):
                        tot += tl.load(part_at + (i0 + jj) * stride_pk, mask=mask & (i0 + jj < n_split), other=0.0,
                                       cache_modifier=".cg")
                tl.store(out_ptr + m[None, :] * stride_om + n[:, None], tot.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next call (CUDA-graph replays included)


@triton.jit
def _tc_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_qn, stride_sg, stride_zg, stride_on,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr):
    """W [N, K] (in the repacked K order) = (q - z) * s of one 128-wide K tile and BLOCK_N outputs, rounded once to
    out's dtype."""
    t = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    i16 = tl.arange(0, 16)
    w = tl.load(qw_ptr + n[:, None] * stride_qn + (t * 16 + i16)[None, :], mask=n_mask[:, None], other=0)
    for j in tl.static_range(8):
        k = t * 128 + j * 16 + i16
        g = (t * 128 + j * 16) // GROUP
        z = _tc_zeros(z_ptr, g, n, n_mask, stride_zg, HAS_ZEROS)
        s = _tc_scales(s_ptr, g, n, n_mask, stride_sg, 0).to(tl.float32)
        q = ((w >> (4 * j)) & 15) - z[:, None]
        tl.store(out_ptr + n[:, None].to(tl.int64) * stride_on + k[None, :],
                 (q.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (k < K)[None, :])


def tc_default_config(M: int, N: int, K: int, sms: int) -> dict:
    """Launch parameters where the table has none (not tuned on a GPU): 128 outputs a program; as many rows as M
    asks up to 128; K split until the programs fill the GPU twice over, each split keeping 2 or more K tiles and the
    fp32 partials (written and read: 8 M N bytes a split) no more bytes than the weight (N K / 2); scales on the
    weight operand from 64 rows a tile (one accumulator instead of two)."""
    block_m = min(128, max(16, triton.next_power_of_2(M)))
    tiles = triton.cdiv(N, 128) * triton.cdiv(M, block_m)
    k_tiles = triton.cdiv(K, 128)
    split = 1
    while tiles * split < 2 * sms and k_tiles // (split * 2) >= 2 and 16 * M * split * 2 <= K:
        split *= 2
    return dict(block_n=128, block_m=block_m, split_k=split, num_warps=4, num_stages=3, scale_a=block_m >= 64)


def _scale_words(scales: torch.Tensor) -> int:
    """The kernel's S_WORDS for these scales: 1 or 2 (fp16, bf16) where they can be read as int32 words (rows of
    whole words: an even row length and stride, 4-byte aligned), else 0."""
    code = {torch.float16: 1, torch.bfloat16: 2}.get(scales.dtype, 0)
    if code and scales.stride(1) == 1 and scales.shape[1] % 2 == 0 and scales.stride(0) % 2 == 0 \
            and scales.data_ptr() % 4 == 0:
        return code
    return 0


def tc_gemm(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
            perm: torch.Tensor | None, group_size: int, out2: torch.Tensor, *, block_n: int, block_m: int,
            split_k: int, num_warps: int, num_stages: int, scale_a: bool = False, wide: bool = False,
            fixup: bool = True, asm: bool | None = None, scale_words: bool = True, even_n: bool = True) -> torch.Tensor:
    """out2 [M, N] = x2 [M, K] @ W^T for W in the tc layout (group_size: the repack's). Launch keywords as in
    tc_default_config, and wide (the kernel's WIDE: one K = 128 dot a tile, for groups of 128 or more; ignored for
    smaller groups); fixup=False sums the K-split partials in a second kernel (torch.sum, also in split order);
    asm=False: the plain-Triton unpack on an NVIDIA GPU too (a check of the PTX); scale_words=False: 16-bit scales
    read as stored, not as int32 words (_tc_scales; an A/B of the two); even_n=False: the N masks kept where block_n
    divides N (the kernel's EVEN_N; an A/B)."""
    M, K = x2.shape
    N = qweight.shape[0]
    assert qweight.shape[1] * 8 >= K and x2.stride(1) == 1 and out2.stride(1) == 1, (qweight.shape, K)
    tiles = triton.cdiv(K, 128)
    split = max(1, min(split_k, tiles))
    per_split = triton.cdiv(tiles, split)
    split = triton.cdiv(tiles, per_split)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split)  # the row tiles of a weight tile share it in L2
    counts = arrival_counts(x2.device, grid[0] * grid[1]) if fixup and split > 1 else None
    mode = 0 if split == 1 else 1 if counts is not None else 2
    part = out2 if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
    z = qzeros if qzeros is not None else scales
    s_words = _scale_words(scales) if scale_words else 0
    s_arg = scales if not s_words else scales.view(torch.int32)
    _tc_kernel[grid](x2, qweight, s_arg, z, perm if perm is not None else qweight, out2, part,
                     counts if counts is not None else part, M, N, K, per_split, split, x2.stride(0), qweight.stride(0),
                     s_arg.stride(0), z.stride(0), out2.stride(0), part.stride(0) if split > 1 else 0,
                     GROUP=group_size, MODE=mode, HAS_ZEROS=qzeros is not None, HAS_PERM=perm is not None,
                     EVEN_K=K % 128 == 0, SCALE_A=scale_a, BLOCK_N=block_n,
                     BLOCK_M=block_m, ASM=(_ptx() if asm is None else asm) and x2.dtype != torch.float32,
                     WIDE=wide and group_size >= 128, S_WORDS=s_words, EVEN_N=even_n and N % block_n == 0,
                     num_warps=num_warps, num_stages=num_stages, **pdl_launch(x2.device))
    if mode == 2:
        torch.sum(part, 0, out=out2)
    return out2


def tc_dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, group_size: int, K: int,
                  dtype: torch.dtype, out: torch.Tensor | None = None, block_n: int = 64) -> torch.Tensor:
    """W [N, K] in dtype, in the repacked K order (act-order: x's columns must go through perm), into out if given."""
    N = qweight.shape[0]
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=qweight.device)
    assert out.shape == (N, K) and out.stride(1) == 1, out.shape
    z = qzeros if qzeros is not None else scales
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, 128))
    _tc_dequant_kernel[grid](qweight, scales, z, out, N, K, qweight.stride(0), scales.stride(0), z.stride(0),
                             out.stride(0), GROUP=group_size, HAS_ZEROS=qzeros is not None, BLOCK_N=block_n,
                             num_warps=4)
    return out
