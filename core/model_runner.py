"""Model runner: owns the KV cache tensors, flattens a scheduled step into tensors, runs the model, samples."""

from __future__ import annotations

import torch

from vserve.core.layers.attention import AttentionMetadata
from vserve.core.model_config import ModelConfig
from vserve.core.request import Request
from vserve.core.sampler import Sampler, SamplerOutput
from vserve.core.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.cfg = model_config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        shape = (num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
        self.kv_caches = []
        for attn in model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            self.kv_caches.append((attn.k_cache, attn.v_cache))
        self.sampler = Sampler(seed)

    def prepare_inputs(self, sched: SchedulerOutput, block_ids: list[list[int]]):
        """Flatten the step: input_ids, positions, attention metadata, and which rows sample.

        Requests come decodes first (one token each), then prefill chunks; a request samples when this
        step reaches its last known token (a prefill chunk short of that only fills the cache)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        context_lens: list[int] = []
        cu_seqlens = [0]
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        num_decodes = 0
        for req, n in zip(sched.requests, sched.num_scheduled_tokens):
            start = req.num_computed_tokens
            end = start + n
            input_ids.extend(req.all_token_ids[start:end])
            positions.append(torch.arange(start, end))
            context_lens.append(end)
            if n == 1 and num_decodes == len(context_lens) - 1:
                num_decodes += 1
            else:
                cu_seqlens.append(cu_seqlens[-1] + n)
            if end == req.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(req)
        max_blocks = max(len(b) for b in block_ids)
        table = torch.zeros(len(block_ids), max_blocks, dtype=torch.long)
        for i, b in enumerate(block_ids):
            table[i, :len(b)] = torch.tensor(b, dtype=torch.long)
        pos = torch.cat(positions)
        seq_of_token = torch.repeat_interleave(torch.arange(len(block_ids)),
                                               torch.tensor(sched.num_scheduled_tokens))
        slots = table[seq_of_token, pos // bs] * bs + pos % bs
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=slots.to(dev),
            block_tables=table.to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=dev),
            num_decodes=num_decodes,
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.long, device=dev),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        return ids, pos.to(dev), md, torch.tensor(sample_rows, dtype=torch.long, device=dev), sample_reqs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_ids: list[list[int]]) -> tuple[list[Request], SamplerOutput]:
        ids, pos, md, rows, reqs = self.prepare_inputs(sched, block_ids)
        hidden = self.model(ids, pos, md)
        if not reqs:
            return [], SamplerOutput([], [])
        logits = self.model.compute_logits(hidden[rows])
        return reqs, self.sampler(logits, reqs)
