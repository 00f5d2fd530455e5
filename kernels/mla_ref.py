"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents: pure-torch references (the
CPU path, and the oracle for kernels/triton_mla.py; prefill runs this one on the GPU too).

Layout: kv_cache [num_blocks, block_size, 1, kv_lora_rank + rope_dim], a token's row = [normed latent c | its
rotated shared RoPE key k_pe] (one "KV head": vLLM's MLA cache). block_tables / context_lens / cu_seqlens_q as in
kernels/paged_attention.py. With w_kv = kv_b_proj's weight viewed [heads, nope + v, kv_lora_rank] = [W_UK | W_UV]:

    key of head h     = [W_UK[h] c | k_pe],   value of head h = W_UV[h] c
    score(q, token)   = (q_nope . W_UK[h] c + q_pe . k_pe) * scale = ([q_nope W_UK[h] | q_pe] . [c | k_pe]) * scale

so decode attends in the latent space (weight absorption: one MQA over the cache rows, head dim kv_lora_rank +
rope_dim, values its first kv_lora_rank dims, then W_UV), and prefill expands the cached latents into per-head keys
and values (cheaper when many queries share them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vserve.kernels.paged_attention import store_kvcache_ref


def store_latent_ref(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Write [latent | k_pe] ([T, r], [T, rope]) into the tokens' slots; slot -1 (padding) is skipped; an fp8 cache
    rounds as store_kvcache_ref does (the one cache given as both k and v: the same rows written twice)."""
    rows = torch.cat((latent, k_pe), dim=-1).unsqueeze(1)
    store_kvcache_ref(rows, rows, kv_cache, kv_cache, slot_mapping)


def _rows(kv_cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n cached rows of one sequence: [n, r + rope]."""
    nb = -(-n // kv_cache.shape[1])
    return kv_cache.index_select(0, block_table[:nb]).flatten(0, 2)[:n]


def mla_decode_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor, w_kv: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """One query per sequence (q_nope [B, H, nope], q_pe [B, H, rope]) over its first context_lens[b] cached rows,
    in the latent space -> [B, H, v]."""
    B, H, nope = q_nope.shape
    r = w_kv.shape[-1]
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    q = torch.cat((torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_pe), dim=-1)  # [B, H, r + rope]
    max_len = int(context_lens.max())
    bs = kv_cache.shape[1]
    nb = -(-max_len // bs)
    kv = kv_cache.index_select(0, block_tables[:, :nb].flatten()).view(B, nb * bs, -1)[:, :max_len].to(q.dtype)
    mask = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kv[:, None], kv[:, None, :, :r],
                                       attn_mask=mask[:, None, None, :], scale=scale).squeeze(2)  # [B, H, r]
    return torch.einsum("bhr,hvr->bhv", o, w_uv)


def mla_prefill_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                              w_kv: torch.Tensor, scale: float) -> torch.Tensor:
    """Varlen causal attention: sequence b's queries q[cu[b]:cu[b+1]] are its last tokens and attend to every cached
    row up to their own position, the rows expanded to per-head keys and values -> [T, H, v]."""
    T, H, nope = q_nope.shape
    r, v_dim = w_kv.shape[-1], w_kv.shape[1] - nope
    out = q_nope.new_empty(T, H, v_dim)
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, T, nope + rope]
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    for b in range(len(ctx)):
        s, e, n = cu[b], cu[b + 1], ctx[b]
        rows = _rows(kv_cache, block_tables[b], n).to(q.dtype)
        kv = F.linear(rows[:, :r], w_kv.flatten(0, 1)).view(n, H, -1).transpose(0, 1)  # [H, n, nope + v]
        k = torch.cat((kv[..., :nope], rows[None, :, r:].expand(H, n, -1)), dim=-1)
        if e - s == n:  # the whole sequence in this chunk: plain causal (no mask tensor for SDPA's kernels)
            o = F.scaled_dot_product_attention(q[:, s:e], k, kv[..., nope:], is_causal=True, scale=scale)
        else:  # queries at positions n - (e - s) .. n - 1
            pos_q = torch.arange(n - (e - s), n, device=q.device)[:, None]
            mask = torch.arange(n, device=q.device)[None, :] <= pos_q
            o = F.scaled_dot_product_attention(q[:, s:e], k, kv[..., nope:], attn_mask=mask, scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out
