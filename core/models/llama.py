"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Mixtral) in one implementation switched by config fields."""

from __future__ import annotations

import torch
from torch import nn

from vserve.core.distributed import get_pp_rank, get_pp_size, get_tp_size, pp_layer_range, shard
from vserve.core.layers.attention import Attention, AttentionMetadata
from vserve.core.layers.fused_moe import SparseMoeBlock
from vserve.core.layers.linear import Linear
from vserve.core.layers.norm import RMSNorm
from vserve.core.layers.quantization import QuantConfig, QuantizedActivation
from vserve.core.layers.rotary import RotaryEmbedding
from vserve.core.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding, compute_logits
from vserve.core.model_config import ModelConfig
from vserve.kernels import for_device


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        heads, kv_heads, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # This rank's heads; KV heads fewer than ranks are replicated (each rank holds one).
        self.h, self.kvh = shard(heads, "attention heads"), max(1, kv_heads // get_tp_size())
        kv_parts = min(kv_heads, get_tp_size())
        if kv_heads % kv_parts or get_tp_size() % kv_parts:
            raise ValueError(f"--tensor-parallel-size {get_tp_size()} must divide or be a multiple of the "
                             f"model's {kv_heads} KV heads")
        self.qkv_proj = Linear(cfg.hidden_size, {"q": heads * self.d, "k": kv_heads * self.d,
                                                 "v": kv_heads * self.d}, bias=cfg.attention_bias,
                               parallel="column", parts={"k": kv_parts, "v": kv_parts}, quant_config=quant,
                               prefix=f"{prefix}.qkv_proj")
        self.o_proj = Linear(heads * self.d, cfg.hidden_size, parallel="row", quant_config=quant,
                             prefix=f"{prefix}.o_proj")
        self.rotary_emb = RotaryEmbedding(self.d, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.attn = Attention(self.h, self.kvh, self.d, self.d ** -0.5)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor | QuantizedActivation,
                md: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        T = qkv.shape[0]
        q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q, k, v = q.view(T, self.h, self.d), k.view(T, self.kvh, self.d), v.view(T, self.kvh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, md)  # v: a view of qkv; the KV store takes its strides
        return self.o_proj(o.reshape(T, self.h * self.d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, {0: self.inter, 1: self.inter}, parallel="column",
                                   quant_config=quant, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = Linear(self.inter, cfg.hidden_size, parallel="row", quant_config=quant,
                                prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        h = self.gate_up_proj(x)
        ops, quant = for_device(h), self.down_proj.input_quant_dtype
        if quant is None:
            return self.down_proj(ops.silu_and_mul(h))
        return self.down_proj(QuantizedActivation(*ops.silu_and_mul_quant(h, quant), h.dtype))  # W8A8: fused


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, quant, f"{prefix}.self_attn")
        if cfg.num_experts:  # Mixtral: a sparse MoE block in place of the MLP
            if quant is not None:
                raise ValueError("quantized MoE models are not served yet (only dense Llama-family ones are)")
            self.mlp = None
            self.block_sparse_moe = SparseMoeBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                                   cfg.intermediate_size)
        else:
            self.mlp = LlamaMLP(cfg, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, md):
        # W8A8 linears take their input quantized per token by the norm before them (None: not quantized)
        qkv_quant = self.self_attn.qkv_proj.input_quant_dtype
        if residual is None:
            x, residual = self.input_layernorm(x, quant_dtype=qkv_quant), x
        else:
            x, residual = self.input_layernorm(x, residual, qkv_quant)
        x = self.self_attn(positions, x, md)
        mlp_quant = None if self.mlp is None else self.mlp.gate_up_proj.input_quant_dtype  # MoE: not quantized
        x, residual = self.post_attention_layernorm(x, residual, mlp_quant)
        return (self.block_sparse_moe(x) if self.mlp is None else self.mlp(x)), residual


class LlamaModel(nn.Module):
    """This pipeline stage's layers (the others are nn.Identity placeholders, so names keep their index)."""

    def __init__(self, cfg: ModelConfig, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.start, self.end = pp_layer_range(cfg.num_hidden_layers)
        self.is_first, self.is_last = get_pp_rank() == 0, get_pp_rank() == get_pp_size() - 1
        # The last stage needs the embedding too when the LM head is tied to it.
        has_embed = self.is_first or (self.is_last and cfg.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if has_embed else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, quant, f"model.layers.{i}") if self.start <= i < self.end
                                    else nn.Identity() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None

    def forward(self, input_ids, positions, md, intermediate=None):
        """Hidden states on the last stage; (x, residual) for the next stage on the others."""
        x, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        for layer in self.layers[self.start:self.end]:
            x, residual = layer(positions, x, residual, md)
        if not self.is_last:
            return x, residual
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (parameter name fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.quant_config = quant_config
        self.model = LlamaModel(cfg, quant_config)
        if cfg.tie_word_embeddings or not self.model.is_last:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)

    def forward(self, input_ids, positions, md: AttentionMetadata, intermediate=None):
        return self.model(input_ids, positions, md, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return compute_logits(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start:self.model.end]]
