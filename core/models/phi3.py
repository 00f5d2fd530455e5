"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): Llama's structure; what differs is in the checkpoint and the
config, so this is Llama's implementation with them: q/k/v and gate/up stored fused (`qkv_proj`, `gate_up_proj`,
the names of vserve's packed layers, split shard by shard at load for TP), LongRoPE scaling (short and long
factors, `original_max_position_embeddings`, the attention factor; the old names su/yarn remapped in
model_config.py), partial rotary (`partial_rotary_factor`), and a sliding window on every layer where set."""

from __future__ import annotations

from vserve.core.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {}  # qkv_proj / gate_up_proj load as fused tensors (Linear._load_fused)
