"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) in one implementation switched by config fields."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vserve.core.layers.attention import Attention, AttentionMetadata
from vserve.core.layers.linear import Linear
from vserve.core.layers.norm import RMSNorm
from vserve.core.layers.rotary import RotaryEmbedding
from vserve.core.model_config import ModelConfig
from vserve.kernels import for_device


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, {"q": self.h * self.d, "k": self.kvh * self.d,
                                                 "v": self.kvh * self.d}, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(self.d, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.attn = Attention(self.h, self.kvh, self.d, self.d ** -0.5)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q, k, v = q.view(T, self.h, self.d), k.view(T, self.kvh, self.d), v.view(T, self.kvh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v.contiguous(), md)
        return self.o_proj(o.reshape(T, self.h * self.d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, {0: self.inter, 1: self.inter})
        self.down_proj = Linear(self.inter, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(for_device(x).silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, md):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, md):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
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

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids, positions, md: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, md)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
