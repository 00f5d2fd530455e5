"""What every decoder-only family shares: the embedding, this pipeline stage's layers, the final norm, the LM head
and the logits (with Gemma 2's final softcap or Command R's logit scale). A family supplies its layer and norms.

A layer is called as layer(positions, x, residual, md) -> (x, residual): x is the block's output, residual the
stream it is added to (None before the first layer), so the add can be fused into the next norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vserve.core.distributed import get_pp_rank, get_pp_size, pp_layer_range
from vserve.core.layers.attention import Attention, AttentionMetadata
from vserve.core.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding, compute_logits
from vserve.core.model_config import ModelConfig


class DecoderModel(nn.Module):
    """This pipeline stage's layers (the others are nn.Identity placeholders, so names keep their index).
    embed_scale: the embeddings are multiplied by it, rounded to the model dtype first (Gemma's sqrt(hidden))."""

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[int, str], nn.Module], norm: Callable[[], nn.Module],
                 embed_scale: float | None = None) -> None:
        super().__init__()
        self.start, self.end = pp_layer_range(cfg.num_hidden_layers)
        self.is_first, self.is_last = get_pp_rank() == 0, get_pp_rank() == get_pp_size() - 1
        # The last stage needs the embedding too when the LM head is tied to it.
        has_embed = self.is_first or (self.is_last and cfg.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if has_embed else None
        # rounded to the model dtype (the default dtype while the model is built), as HF multiplies
        self.embed_scale = None if embed_scale is None else float(
            torch.tensor(embed_scale, dtype=torch.get_default_dtype(), device="cpu"))
        self.layers = nn.ModuleList(make_layer(i, f"model.layers.{i}") if self.start <= i < self.end
                                    else nn.Identity() for i in range(cfg.num_hidden_layers))
        self.norm = norm() if self.is_last else None

    def forward(self, input_ids, positions, md, intermediate=None):
        """Hidden states on the last stage; (x, residual) for the next stage on the others."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                x = x * self.embed_scale
        else:
            x, residual = intermediate
        for layer in self.layers[self.start:self.end]:
            x, residual = layer(positions, x, residual, md)
        if not self.is_last:
            return x, residual
        x, _ = self.norm(x, residual)
        return x


class PreNormDecoderLayer(nn.Module):
    """input_layernorm -> self_attn -> post_attention_layernorm -> mlp, each residual add fused into the next norm
    (the MoE and MLA families; Llama's own layer also passes W8A8 inputs through its norms)."""

    def forward(self, positions, x, residual, md):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """A DecoderModel (`self.model`, built by the subclass) and its LM head, tied to the embedding or not."""

    packed_modules_mapping: dict = {}  # checkpoint name fragment -> (parameter name fragment, shard id)

    def __init__(self, cfg: ModelConfig, quant_config=None) -> None:
        super().__init__()
        self.config = cfg
        self.quant_config = quant_config

    def make_lm_head(self) -> None:
        cfg = self.config
        tied = cfg.tie_word_embeddings or not self.model.is_last
        self.lm_head = None if tied else ParallelLMHead(cfg.vocab_size, cfg.hidden_size)

    def forward(self, input_ids, positions, md: AttentionMetadata, intermediate=None):
        return self.model(input_ids, positions, md, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits; Command R's logit_scale and Gemma 2's final softcap (cap * tanh(logits / cap))."""
        logits = compute_logits(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head)
        cfg = self.config
        if cfg.logit_scale is not None:
            logits = logits * cfg.logit_scale
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start:self.model.end]]
