"""Qwen-MoE: Qwen2-MoE / Qwen1.5-MoE (q/k/v bias, a shared expert behind a sigmoid gate beside the routed ones) and
Qwen3-MoE (RMSNorm on each q/k head, no shared expert, 128 experts top-8). Llama's attention; the MLP of layer i is
sparse unless i is in mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step."""

from __future__ import annotations

import torch
from torch import nn

from vserve.core.distributed import all_reduce
from vserve.core.layers.fused_moe import FusedMoE, softmax_top_k
from vserve.core.layers.linear import Linear
from vserve.core.layers.mlp import GatedMLP
from vserve.core.layers.norm import RMSNorm
from vserve.core.layers.quantization import QuantConfig
from vserve.core.model_config import ModelConfig
from vserve.core.models.base import CausalLM, DecoderModel, PreNormDecoderLayer
from vserve.core.models.llama import LlamaForCausalLM, QKVAttention, llama_rotary


def num_experts(cfg: ModelConfig) -> int:
    return int(cfg.raw.get("num_experts") or cfg.raw.get("num_local_experts") or 0)


def is_sparse_layer(cfg: ModelConfig, layer: int) -> bool:
    raw = cfg.raw
    return (num_experts(cfg) > 0 and layer not in (raw.get("mlp_only_layers") or [])
            and (layer + 1) % (raw.get("decoder_sparse_step") or 1) == 0)


class QwenMoeBlock(nn.Module):
    """Routed experts (softmax top-k, renormalized where norm_topk_prob) plus, for Qwen2-MoE, the shared expert
    scaled by sigmoid(shared_expert_gate(x)); router and shared gate replicated over TP ranks."""

    def __init__(self, cfg: ModelConfig, prefix: str) -> None:
        super().__init__()
        raw = cfg.raw
        self.top_k, self.renormalize = raw["num_experts_per_tok"], bool(raw.get("norm_topk_prob", False))
        self.gate = Linear(cfg.hidden_size, num_experts(cfg))
        self.experts = FusedMoE(num_experts(cfg), cfg.hidden_size, raw["moe_intermediate_size"])
        shared = raw.get("shared_expert_intermediate_size") or 0
        self.shared_expert = GatedMLP(cfg.hidden_size, shared, cfg.hidden_act, None,
                                      f"{prefix}.shared_expert") if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_top_k(self.gate(x), self.top_k, self.renormalize)
        out = all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class QwenMoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, quant: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        norms = dict(q_norm=RMSNorm(cfg.head_dim, cfg.rms_norm_eps),
                     k_norm=RMSNorm(cfg.head_dim, cfg.rms_norm_eps)) if cfg.qk_norm else {}
        self.self_attn = QKVAttention(cfg, layer, quant, f"{prefix}.self_attn", rotary=llama_rotary(cfg), **norms)
        self.mlp = QwenMoeBlock(cfg, f"{prefix}.mlp") if is_sparse_layer(cfg, layer) else \
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, None, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class QwenMoeForCausalLM(CausalLM):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        if quant_config is not None:
            raise ValueError("quantized MoE models are not served yet (only dense Llama-family ones are)")
        super().__init__(cfg, quant_config)
        self.model = DecoderModel(cfg, lambda i, prefix: QwenMoeDecoderLayer(cfg, i, None, prefix),
                                  lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_lm_head()
