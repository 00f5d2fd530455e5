"""MLA over the paged latent cache on the GPU, from the paged-attention kernels of kernels/triton_attention.py: the
latent cache is a KV cache of one head of kv_lora_rank + rope_dim dims, so

- store: store_kvcache with [c | k_pe] as both k and v into the one cache (the same values written twice);
- decode (weight absorption): q_nope W_UK[h] (a batched matmul) joined with q_pe is an MQA query of H heads; the
  split-KV decode kernel attends it over the cache as both keys and values (every head of the group against each
  tile read once); the first kv_lora_rank dims of its output, times W_UV[h], are the heads' outputs. No host sync:
  a CUDA graph can hold it;
- prefill: kernels/mla_ref.py's (the cached latents expanded per sequence, torch SDPA).

Matches kernels/mla_ref.py (same signatures).
"""

from __future__ import annotations

import torch

from vserve.kernels.mla_ref import mla_prefill_attention_ref as mla_prefill_attention  # noqa: F401
from vserve.kernels.triton_attention import paged_decode_attention, store_kvcache

MLA_BLOCK_N = 16  # KV tile tokens: a 576-dim row pads to 1024 dims in the kernel; 16 tokens keep K and V tiles small


def store_latent(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As store_latent_ref: [latent | k_pe] into the tokens' slots, slot -1 skipped."""
    rows = torch.cat((latent, k_pe), dim=-1).unsqueeze(1)
    store_kvcache(rows, rows, kv_cache, kv_cache, slot_mapping)


def mla_decode_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, w_kv: torch.Tensor, scale: float, *,
                         block_n: int = MLA_BLOCK_N, num_warps: int = 8) -> torch.Tensor:
    """As mla_decode_attention_ref: q_nope [B, H, nope], q_pe [B, H, rope] -> [B, H, v]."""
    nope, r = q_nope.shape[-1], w_kv.shape[-1]
    q = torch.cat((torch.bmm(q_nope.transpose(0, 1), w_kv[:, :nope]).transpose(0, 1), q_pe), dim=-1)
    o = paged_decode_attention(q, kv_cache, kv_cache, block_tables, context_lens, scale, block_n=block_n,
                               num_warps=num_warps)
    return torch.bmm(o[..., :r].transpose(0, 1), w_kv[:, nope:].transpose(1, 2)).transpose(0, 1)
