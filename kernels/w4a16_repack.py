"""The tensor-core layout of 4-bit weights ("tc"), made once at load from AWQ, GPTQ (act-order too) and
compressed-tensors pack-quantized tensors, for kernels/triton_w4a16_tc.py (the torch side: repack, unpack, and which
weights qualify).

The kernel multiplies W [N, K] as the left operand of its dot (weight rows on the MMA's 64-row side, tokens on its
narrow side), so its register fragments hold consecutive K values of one output row. Codes are therefore packed along
K, and interleaved so that one shift-and-mask of a word gives every thread its part of one 16-wide K slice:

- qweight int32 [N, Kp / 8], Kp = K rounded up to 128 (padding codes 0, read against zero activations): K runs in
  tiles of 128; word t * 16 + i of a row holds, in its bits 4j..4j+3, the code of input k = t * 128 + j * 16 + i
  (field j of the 16 words of a tile is the tile's j-th 16-wide slice);
- scales [G, N] (the checkpoint's dtype: fp16 for AWQ/GPTQ, fp32 for pack), G = cdiv(Kp, group_size);
- qzeros int32 [G, cdiv(N, 8)]: the zero points themselves (GPTQ's stored zero - 1 undone), output n in field n % 8;
  None for symmetric weights (pack: zero 2^(bits-1));
- perm int32 [K] for GPTQ act-order, None otherwise: K is sorted by group at load (input k of the repacked weight is
  input perm[k] of the checkpoint), so groups are contiguous again, and the kernel reads x's columns through perm.

Bytes: the same as the checkpoint's tensors when 128 divides K (act-order's perm replaces g_idx).
"""

from __future__ import annotations

import torch

from vserve.quantize.formats import AWQ_ORDER, _to_int32, pack_int32, unpack_int32

TILE_K = 128  # K per tile of the layout: 8 slices of 16 (the MMA's K)
SLICE = 16
ROWS_PER_STEP = 4096  # output rows repacked at a time (bounds the int64 temporaries at load)


def tc_group_size(group_size: int, K: int) -> int | None:
    """The group size the tc kernel works with (per-channel -> the padded K), or None where the layout cannot hold it:
    a group must cover whole 16-wide slices and either fit a tile (16, 32, 64) or be whole tiles."""
    kp = -(-K // TILE_K) * TILE_K
    if group_size >= K:
        return kp
    if group_size % SLICE or (group_size > TILE_K and group_size % TILE_K) or (TILE_K % group_size and
                                                                               group_size < TILE_K):
        return None
    return group_size


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The sort of K by group that makes act-order groups contiguous, or None where the sorted groups are not all
    group_size wide (a row-parallel rank's slice of an act-order layer: its groups have uneven sizes)."""
    perm = torch.argsort(g_idx.to(torch.int64), stable=True)
    uniform = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    return perm.to(torch.int32) if torch.equal(g_idx[perm].to(torch.int64), uniform) else None


def checkpoint_codes(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, layout: str,
                     bits: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Output rows `rows` of a checkpoint weight: codes int32 [r, K], zeros int32 [r, G] (None: symmetric), scales
    [r, G] in their stored dtype."""
    if layout == "awq":  # qweight [K, N/8], qzeros [G, N/8] in AutoAWQ's nibble order, scales [G, N]
        w0, w1 = rows.start // 8, -(-rows.stop // 8)
        off = rows.start - w0 * 8
        n = rows.stop - rows.start
        q = unpack_int32(qweight[:, w0:w1], 4, AWQ_ORDER)[:, off:off + n].t()
        z = unpack_int32(qzeros[:, w0:w1], 4, AWQ_ORDER)[:, off:off + n].t()
        return q.contiguous(), z.contiguous(), scales[:, rows].t()
    if layout == "gptq":  # qweight [K/8, N] packed along K, qzeros [G, N/8] hold zero - 1
        q = unpack_int32(qweight[:, rows].t().contiguous(), bits)
        per = 32 // bits
        w0, w1 = rows.start // per, -(-rows.stop // per)
        off = rows.start - w0 * per
        z = (unpack_int32(qzeros[:, w0:w1], bits)[:, off:off + rows.stop - rows.start] + 1) & (2**bits - 1)
        return q, z.t().contiguous(), scales[:, rows].t()
    assert layout == "pack", layout  # qweight [N, K/8] packed along K, scales [N, G], symmetric
    return unpack_int32(qweight[rows], bits), None, scales[rows]


def repack(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, g_idx: torch.Tensor | None,
           layout: str, bits: int, group_size: int, K: int, N: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """A checkpoint weight (w4a16_gemm's arguments; g_idx only for act-order) -> the tc layout: (qweight, scales,
    qzeros, perm, group_size). Lossless (tc_unpack gives the same codes, zeros and scales). The caller checks
    eligibility first (4-bit; tc_group_size; act_order_perm)."""
    assert bits == 4, bits
    gs = tc_group_size(group_size, K)
    assert gs is not None, (group_size, K)
    perm = None
    if g_idx is not None:
        perm = act_order_perm(g_idx, group_size)
        assert perm is not None, "act-order groups of uneven sizes"
    kp = -(-K // TILE_K) * TILE_K
    groups = -(-kp // gs)
    dev = qweight.device
    out_q = torch.empty(N, kp // 8, dtype=torch.int32, device=dev)
    out_s = torch.zeros(N, groups, dtype=scales.dtype, device=dev)
    zeros = torch.zeros(N, groups, dtype=torch.int32, device=dev) if layout != "pack" else None
    shifts = torch.arange(8, device=dev, dtype=torch.int64)[None, None, :, None] * 4
    for r0 in range(0, N, ROWS_PER_STEP):
        rows = slice(r0, min(N, r0 + ROWS_PER_STEP))
        q, z, s = checkpoint_codes(qweight, scales, qzeros, layout, bits, rows)
        if perm is not None:  # sort K by group (the zeros and scales stay per group: k // group_size after it)
            q = q[:, perm.long()]
        r = q.shape[0]
        q = torch.nn.functional.pad(q, (0, kp - K)).to(torch.int64).view(r, kp // TILE_K, 8, SLICE)
        out_q[rows] = _to_int32((q << shifts).sum(2)).view(r, kp // 8)
        out_s[rows, :s.shape[1]] = s
        if zeros is not None:
            zeros[rows, :z.shape[1]] = z
    if zeros is not None:  # [G, cdiv(N, 8)], output n in field n % 8
        zeros = pack_int32(torch.nn.functional.pad(zeros, (0, 0, 0, (-N) % 8)).t(), 4)
    return out_q, out_s.t().contiguous(), zeros, perm, gs


def tc_unpack(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, bits: int = 4
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tc layout -> codes int32 [N, Kp] in the repacked K order, zeros int32 [N, G] (2^(bits-1) when symmetric),
    scales [N, G]."""
    N, kp = qweight.shape[0], qweight.shape[1] * 8
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int32)[None, None, :, None] * 4
    words = qweight.view(N, kp // TILE_K, 1, SLICE)
    q = ((words >> shifts) & 15).reshape(N, kp)
    s = scales.t()
    if qzeros is None:
        z = torch.full(s.shape, 2 ** (bits - 1), dtype=torch.int32, device=s.device)
    else:
        z = unpack_int32(qzeros, 4).t()[:N]
    return q, z.contiguous(), s.contiguous()


def tc_dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, perm: torch.Tensor | None,
                  group_size: int, K: int) -> torch.Tensor:
    """W [N, K] float32 = (q - z) * s in the checkpoint's K order (perm undone)."""
    q, z, s = tc_unpack(qweight, scales, qzeros)
    g = torch.arange(q.shape[1], device=q.device) // group_size
    w = ((q.float() - z.float()[:, g]) * s.float()[:, g])[:, :K]
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm.long()] = w
    return out
