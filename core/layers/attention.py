"""Attention over the paged KV cache: store this step's k/v, then decode rows batched, prefill rows varlen."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vserve.kernels import for_device


@dataclass
class AttentionMetadata:
    """One step's flattened batch. Rows [0, num_decode_tokens) are decodes (one query each), the rest
    are prefill chunks described by cu_seqlens_q; block_tables/context_lens cover decodes then prefills."""

    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    context_lens: torch.Tensor  # [num_seqs]
    num_decodes: int
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1], offsets into the prefill rows


class Attention(nn.Module):
    """sliding_window: a query at position p sees the cached tokens p - window < j <= p (None: all up to p).
    logits_soft_cap: scores become cap * tanh(scores / cap) before the softmax (Gemma 2)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, H, d], k/v [T, kvh, d] -> [T, H, d]. rope (positions, cos, sin): q and k not rotated yet; their
        rotate-half RoPE is applied in the same launch as the KV store (rope_store_kvcache)."""
        ops = for_device(q)
        if rope is None:
            ops.store_kvcache(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        else:
            positions, cos, sin = rope
            q = ops.rope_store_kvcache(positions, q, k, v, cos, sin, self.k_cache, self.v_cache, md.slot_mapping)
        nd = md.num_decodes
        kw = {}  # only when set: the plain calls stay the ones every kernel test and benchmark makes
        if self.sliding_window is not None:
            kw["window"] = self.sliding_window
        if self.logits_soft_cap is not None:
            kw["softcap"] = self.logits_soft_cap
        if nd == q.shape[0]:
            return ops.paged_decode_attention(q, self.k_cache, self.v_cache, md.block_tables, md.context_lens,
                                              self.scale, **kw)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = ops.paged_decode_attention(q[:nd], self.k_cache, self.v_cache, md.block_tables[:nd],
                                                  md.context_lens[:nd], self.scale, **kw)
        out[nd:] = ops.paged_prefill_attention(q[nd:], self.k_cache, self.v_cache, md.cu_seqlens_q,
                                               md.context_lens[nd:], md.block_tables[nd:], self.scale, **kw)
        return out
