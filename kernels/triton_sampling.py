"""Triton sampling kernels: one inverse-CDF draw per row straight from the processed logits.

Replaces softmax + cumsum + searchsorted (three launches and several full passes over [B, V]). Two paths, chosen
by sample_from_logits:

- One program per row (large batches, where rows alone fill the GPU): pass 1 reads the row in BLOCK-sized steps
  keeping a per-lane online max and sum of exp(x - max), so the loop has no cross-lane reduction; pass 2 walks the
  row again with a running sum (tl.cumsum within a step) and stops in the step whose prefix reaches
  (1 - u) * sum, so it reads half the row on average.
- Split rows (small batches, where one program per row would leave most SMs idle: an 8B model's 128,256 logits
  took 45 µs at batch 1 on an H200): kernel A, a program per (row, chunk), writes each chunk's max and sum of
  exp(x - chunk max) to a [B, P, 2] scratch; kernel B, a program per row, combines the P partials into the row's
  max and total, finds the first chunk whose cumulative mass reaches the target and walks from there (the mass
  before it as the running sum), so it reads about half a chunk.

Both match sample_from_logits_ref (kernels/sampling_ref.py) token for token, up to float summation order at an
exact CDF boundary; the zero-mass rule (never a token with probability 0) is the reference's. Math is fp32;
logits fp32/fp16/bf16 with a unit stride along the vocabulary. Nothing is read back to the host, so both paths
can be captured in a CUDA graph; the split kernels compile once for every batch size, and warm_up compiles them all at
the engine's start.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MIN_CHUNK = 2048  # columns per split program at the least: shorter chunks add programs, not bandwidth


@triton.jit
def _max_and_sum(x_row, lo, hi, BLOCK: tl.constexpr):
    """Over columns [lo, hi) of a row: the max (-inf without a finite logit) and the sum of exp(x - max) (0 then,
    not NaN). Per lane an online max and sum, so the loop has no cross-lane reduction."""
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(lo, hi, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < hi, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane without a finite logit yet keeps s = 0
        s = s * tl.exp(m - ref) + tl.exp(x - ref)
        m = m_new
    mx = tl.max(m, axis=0)
    return mx, tl.sum(s * tl.exp(m - tl.where(mx == float("-inf"), 0.0, mx)), axis=0)


@triton.jit
def _draw(x_row, start, end, row_max, target, running, BLOCK: tl.constexpr):
    """Walk columns [start, end) BLOCK at a time with a running sum of exp(x - row_max) that starts at `running`
    (the mass before start, below the target unless the row has no mass) until a step holds the first column whose
    inclusive prefix reaches the target. The zero-mass rule gives the token: the last column with mass at or before
    that one (the last in [start, end) when rounding left the target above every prefix), 0 without mass. No
    column from end on may have mass."""
    offs = tl.arange(0, BLOCK)
    first = end  # none reached yet
    last_nz = -1
    while (first == end) & (start < end):
        cols = start + offs
        p = tl.exp(tl.load(x_row + cols, mask=cols < end, other=float("-inf")).to(tl.float32) - row_max)
        prefix = running + tl.cumsum(p, axis=0)
        first = tl.min(tl.where((prefix >= target) & (cols < end), cols, end), axis=0)
        last_nz = tl.maximum(last_nz, tl.max(tl.where((p > 0) & (cols <= first), cols, -1), axis=0))
        running = tl.sum(tl.where(offs == BLOCK - 1, prefix, 0.0), axis=0)  # the step's last prefix, exactly
        start += BLOCK
    return tl.maximum(last_nz, 0)


@triton.jit
def _sample_kernel(logits_ptr, u_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    """One program per row: pass 1 over the whole row, then the walk from column 0."""
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * stride
    row_max, total = _max_and_sum(x_row, 0, V, BLOCK)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row without mass: zeros below, not NaN
    target = (1.0 - tl.load(u_ptr + row)) * total
    start = 0  # assigned, so a tensor: _draw's loop advances it
    running = 0.0
    tl.store(out_ptr + row, _draw(x_row, start, V, row_max, target, running, BLOCK).to(tl.int64))


@triton.jit(do_not_specialize=["C"])  # C and P vary with the batch size: one compiled variant serves every B
def _chunk_partials_kernel(logits_ptr, part_ptr, V, stride, C, BLOCK: tl.constexpr):
    """Split kernel A, program (row, p): columns [p * C, min((p + 1) * C, V)) -> part[row, p] = (max, sum of
    exp(x - max)); (-inf, 0) for a chunk without a finite logit."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    lo = p * C
    m, s = _max_and_sum(logits_ptr + row * stride, lo, tl.minimum(lo + C, V), BLOCK)
    out = part_ptr + (row * tl.num_programs(1) + p) * 2
    tl.store(out, m)
    tl.store(out + 1, s)


@triton.jit(do_not_specialize=["P", "C"])
def _split_draw_kernel(logits_ptr, u_ptr, part_ptr, out_ptr, V, stride, P, C, BLOCK: tl.constexpr,
                       P_BLOCK: tl.constexpr):
    """Split kernel B, one program per row: the row's max and total from its P chunk partials, then the walk from
    the first chunk whose cumulative mass reaches the target (the last chunk with mass if rounding left the target
    above them all). Either way the mass before that chunk is below the target and the walk, which ends with the
    last chunk with mass, continues past the chunk only where its rescan does not cross (rounding)."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, P_BLOCK)
    part = part_ptr + (row * P + lanes) * 2
    m = tl.load(part, mask=lanes < P, other=float("-inf"))
    row_max = tl.max(m, axis=0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row without mass: zeros below, not NaN
    mass = tl.load(part + 1, mask=lanes < P, other=0.0) * tl.exp(m - row_max)  # 0 for a chunk without mass
    target = (1.0 - tl.load(u_ptr + row)) * tl.sum(mass, axis=0)
    cum = tl.cumsum(mass, axis=0)
    last = tl.max(tl.where(mass > 0, lanes, -1), axis=0)  # -1: a row without mass, token 0
    q = tl.min(tl.where((cum >= target) & (lanes < P), lanes, P_BLOCK), axis=0)
    q = tl.maximum(tl.minimum(q, last), 0)
    running = tl.sum(tl.where(lanes == q - 1, cum, 0.0), axis=0)  # cum[q - 1], exactly; 0 for q = 0
    start = q * C
    tok = _draw(logits_ptr + row * stride, start, tl.minimum((last + 1) * C, V), row_max, target, running, BLOCK)
    tl.store(out_ptr + row, tok.to(tl.int64))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(B: int, V: int, splits: int | None, block: int, device: torch.device) -> tuple[int, int]:
    """(P, C): chunks per row and columns per chunk (a multiple of block, P = cdiv(V, C)) for `splits` chunks
    asked. None asks, below one row per SM, for enough (row, chunk) programs to fill twice the SMs, of MIN_CHUNK
    columns at least; from one row per SM on (where the rows alone fill the GPU, and the one-program kernel is the
    path every measured large-batch row ran) and off CUDA (the interpreter) it asks for 1. P < 2 means one program
    per row."""
    if splits is None:
        sms = _num_sms(device) if device.type == "cuda" else 0
        if B >= sms:
            return 1, V
        splits = min(triton.cdiv(V, MIN_CHUNK), triton.cdiv(2 * sms, B))
    C = triton.cdiv(triton.cdiv(V, max(splits, 1)), block) * block
    return triton.cdiv(V, C), C


def sample_from_logits(logits: torch.Tensor, u: torch.Tensor, *, block: int = 4096, num_warps: int = 16,
                       splits: int | None = None, split_block: int = 1024, split_warps: int = 4) -> torch.Tensor:
    """As sample_from_logits_ref: logits [B, V] (masked entries -inf), u [B] uniform in [0, 1) -> tokens [B]
    int64, a new tensor. Rows split into chunks of a multiple of split_block columns (split_plan: `splits` asked,
    None to choose by batch size and SM count, 1 never) go through split kernels A and B, `split_block` columns at a
    time; otherwise one program per row reads `block` columns at a time."""
    B, V = logits.shape
    assert u.shape == (B,), (u.shape, B)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    u = u.float().contiguous()
    P, C = split_plan(B, V, splits, split_block, logits.device)
    if P < 2:
        _sample_kernel[(B,)](logits, u, out, V, logits.stride(0), BLOCK=min(block, triton.next_power_of_2(V)),
                             num_warps=num_warps)
        return out
    part = torch.empty(B, P, 2, dtype=torch.float32, device=logits.device)
    _chunk_partials_kernel[(B, P)](logits, part, V, logits.stride(0), C, BLOCK=split_block, num_warps=split_warps)
    # P_BLOCK from V alone (P <= cdiv(V, split_block)), not from P, so no batch size compiles a variant of its own
    _split_draw_kernel[(B,)](logits, u, part, out, V, logits.stride(0), P, C, BLOCK=split_block,
                             P_BLOCK=triton.next_power_of_2(triton.cdiv(V, split_block)), num_warps=split_warps)
    return out


def warm_up(vocab_size: int, device: torch.device) -> None:
    """Compile (or load from Triton's cache) every sampling kernel a step can launch on a [B, vocab_size] float32
    batch, before the first request: the split path (B below one row per SM), the one-program path and the
    structured-output bitmask. Otherwise each compiles in the first step that needs it (~1 s on an empty cache)."""
    rows = _num_sms(device)
    logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
    u = torch.zeros(rows, dtype=torch.float32, device=device)
    for b in (1, rows):
        sample_from_logits(logits[:b], u[:b])
    apply_token_bitmask(logits, torch.full((1, triton.cdiv(vocab_size, 32)), -1, dtype=torch.int32, device=device),
                        torch.zeros(1, dtype=torch.long, device=device))


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, V, W, stride, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    row = tl.load(rows_ptr + j).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(mask_ptr + j * W + cols // 32, mask=cols // 32 < W, other=0)
    banned = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride + cols, tl.full((BLOCK,), float("-inf"), tl.float32), mask=(cols < V) & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, *,
                        block: int = 1024) -> None:
    """apply_token_bitmask_ref (kernels/sampling_ref.py) in one launch over the constrained rows: a program per
    (row, BLOCK columns) reads its bitmask words and writes -inf where a token is not allowed."""
    assert logits.stride(1) == 1 and bitmask.is_contiguous()
    if rows.numel() == 0:
        return
    V, W = logits.shape[1], bitmask.shape[1]
    _bitmask_kernel[(rows.numel(), triton.cdiv(V, block))](logits, bitmask, rows, V, W, logits.stride(0),
                                                           BLOCK=block)
