"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Mixtral; Yi, DeepSeek-LLM and InternLM2-as-Llama load as
Llama) in one implementation switched by config fields."""

from __future__ import annotations

import torch
from torch import nn

from vserve.core.distributed import get_tp_size, shard
from vserve.core.layers.attention import Attention, AttentionMetadata
from vserve.core.layers.fused_moe import SparseMoeBlock
from vserve.core.layers.linear import Linear
from vserve.core.layers.mlp import GatedMLP
from vserve.core.layers.norm import RMSNorm
from vserve.core.layers.quantization import QuantConfig, QuantizedActivation
from vserve.core.layers.rotary import RotaryEmbedding
from vserve.core.model_config import ModelConfig
from vserve.core.models.base import CausalLM, DecoderModel


def kv_head_parts(kv_heads: int) -> int:
    """Slices the KV heads are cut into over the TP ranks (fewer heads than ranks: each rank holds a replica)."""
    parts = min(kv_heads, get_tp_size())
    if kv_heads % parts or get_tp_size() % parts:
        raise ValueError(f"--tensor-parallel-size {get_tp_size()} must divide or be a multiple of the "
                         f"model's {kv_heads} KV heads")
    return parts


class QKVAttention(nn.Module):
    """Packed q/k/v projection -> (per-head norm) -> RoPE -> paged attention -> o_proj: the attention block of every
    family here; q_norm/k_norm (modules over [T, heads, d]), the rotary embedding (None: no positions, Command R7B's
    global layers), scale, window and softcap are the family's."""

    def __init__(self, cfg: ModelConfig, layer: int, quant: QuantConfig | None, prefix: str, *,
                 rotary: RotaryEmbedding | None, scale: float | None = None, bias: bool | None = None,
                 o_bias: bool = False, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> None:
        super().__init__()
        heads, kv_heads, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.h, self.kvh = shard(heads, "attention heads"), max(1, kv_heads // get_tp_size())
        kv_parts = kv_head_parts(kv_heads)
        self.qkv_proj = Linear(cfg.hidden_size, {"q": heads * self.d, "k": kv_heads * self.d,
                                                 "v": kv_heads * self.d},
                               bias=cfg.attention_bias if bias is None else bias, parallel="column",
                               parts={"k": kv_parts, "v": kv_parts}, quant_config=quant, prefix=f"{prefix}.qkv_proj")
        self.o_proj = Linear(heads * self.d, cfg.hidden_size, bias=o_bias, parallel="row", quant_config=quant,
                             prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary
        self.q_norm, self.k_norm = q_norm, k_norm
        self.attn = Attention(self.h, self.kvh, self.d, self.d ** -0.5 if scale is None else scale,
                              cfg.layer_window(layer), cfg.attn_logit_softcapping)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | QuantizedActivation,
                md: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        T = qkv.shape[0]
        q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q, k, v = q.view(T, self.h, self.d), k.view(T, self.kvh, self.d), v.view(T, self.kvh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = self.rotary_emb
        if rope is not None and rope.rotates_whole_heads:  # RoPE in the KV store's launch
            o = self.attn(q, k, v, md, rope=(positions, rope.cos, rope.sin))
        else:
            if rope is not None:
                q, k = rope(positions, q, k)
            o = self.attn(q, k, v, md)  # v: a view of qkv; the KV store takes its strides
        return self.o_proj(o.reshape(T, self.h * self.d))


def llama_rotary(cfg: ModelConfig) -> RotaryEmbedding:
    rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, rotary_dim)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        norms = dict(q_norm=RMSNorm(cfg.head_dim, cfg.rms_norm_eps),
                     k_norm=RMSNorm(cfg.head_dim, cfg.rms_norm_eps)) if cfg.qk_norm else {}
        self.self_attn = QKVAttention(cfg, layer, quant, f"{prefix}.self_attn", rotary=llama_rotary(cfg), **norms)
        if cfg.num_experts:  # Mixtral: a sparse MoE block in place of the MLP
            if quant is not None:
                raise ValueError("quantized MoE models are not served yet (only dense Llama-family ones are)")
            self.mlp = None
            self.block_sparse_moe = SparseMoeBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                                   cfg.intermediate_size)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, quant, f"{prefix}.mlp")
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


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__(cfg, quant_config)
        self.model = DecoderModel(cfg, lambda i, prefix: LlamaDecoderLayer(cfg, i, quant_config, prefix),
                                  lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_lm_head()
