"""Paged attention: pure-torch references (the CPU path and the oracle for the Triton kernels).

Layouts: k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
block_id * block_size + offset; block_tables [batch, max_blocks] (padding entries are ignored);
context_lens [batch] counts every token a sequence attends to (cached prefix + this step's tokens).
The cache is in the model's dtype or float8 e4m3fn (`--kv-cache-dtype fp8`), read back in the queries' dtype.
window (sliding-window layers): a query at position p sees only the tokens p - window < j <= p, so blocks wholly
before that may hold anything (the KV manager frees them). softcap (Gemma 2): scores -> softcap * tanh(scores /
softcap) before the mask and softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # float8 e4m3fn's largest value


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, kvh, d] into their slots; slot -1 (padding) is skipped. An fp8 e4m3 cache gets the values
    rounded to nearest, saturating at +-448 (no scale: vLLM's default k/v scale of 1)."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    for x, cache in ((k, k_cache), (v, v_cache)):
        x = x.to(cache.dtype) if cache.dtype != torch.float8_e4m3fn else \
            x.float().clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)  # torch's cast alone turns |x| > 464 into NaN
        if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernels: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x)


def rope_store_kvcache_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of q and k (as rotary_embedding_ref), the rotated k and v written into their slots (as
    store_kvcache_ref): the attention layer's first two steps in one call. Returns the rotated q."""
    from vserve.kernels.ops_ref import rotary_embedding_ref

    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos, sin)
    store_kvcache_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


def _gather(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n cached tokens of one sequence: [n, kvh, d]."""
    bs = cache.shape[1]
    nb = -(-n // bs)
    return cache.index_select(0, block_table[:nb]).flatten(0, 1)[:n]


def _upcast(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """An fp8 cache's values in the queries' dtype (exact: every e4m3 value is a bf16/fp16/fp32 value)."""
    return kv if kv.dtype == q.dtype else kv.to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """softmax(q k^T scale (soft-capped), masked) v for q [..., H, Lq, d], k/v [..., kvh, Lk, d]; mask broadcasts
    to [..., H, Lq, Lk] (True: attend)."""
    gqa = k.shape[-3] != q.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return (p @ v.float()).to(q.dtype)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, H, d] attends to its first context_lens[b] cached tokens (the last
    window of them for a sliding-window layer)."""
    B, H, d = q.shape
    max_len = int(context_lens.max())
    bs = k_cache.shape[1]
    nb = -(-max_len // bs)
    bt = block_tables[:, :nb].flatten()  # index_select: ~2x faster than advanced indexing on CPU
    k = _upcast(k_cache.index_select(0, bt).view(B, nb * bs, *k_cache.shape[2:])[:, :max_len].transpose(1, 2), q)
    v = _upcast(v_cache.index_select(0, bt).view(B, nb * bs, *v_cache.shape[2:])[:, :max_len].transpose(1, 2), q)
    j = torch.arange(max_len, device=q.device)[None, :]
    mask = j < context_lens[:, None]
    if window is not None:
        mask &= j >= context_lens[:, None] - window
    return _attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, softcap).squeeze(2)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                block_tables: torch.Tensor, scale: float, window: int | None = None,
                                softcap: float | None = None) -> torch.Tensor:
    """Varlen causal attention: sequence b's queries q[cu[b]:cu[b+1]] are its last tokens and attend to
    every cached token up to their own position (cached prefix + this chunk), the last window of them for a
    sliding-window layer."""
    out = torch.empty_like(q)
    H = q.shape[1]
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    for b in range(len(ctx)):
        s, e, n = cu[b], cu[b + 1], ctx[b]
        qlen = e - s
        k = _upcast(_gather(k_cache, block_tables[b], n).transpose(0, 1), q)  # [kvh, n, d]
        v = _upcast(_gather(v_cache, block_tables[b], n).transpose(0, 1), q)
        qb = q[s:e].transpose(0, 1)  # [H, qlen, d]
        gqa = k.shape[0] != H
        if qlen == n and window is None and softcap is None:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # queries sit at positions n - qlen .. n - 1
            pos_q = torch.arange(n - qlen, n, device=q.device)[:, None]
            j = torch.arange(n, device=q.device)[None, :]
            mask = (j <= pos_q) if window is None else (j <= pos_q) & (j > pos_q - window)
            o = _attend(qb, k, v, mask, scale, softcap)
        out[s:e] = o.transpose(0, 1)
    return out
