"""Gemma 1, 2 and 3 (text) in one implementation switched by architecture.

All: embeddings scaled by sqrt(hidden) (rounded to the model dtype), RMSNorm as x (1 + w) in fp32, a GELU-tanh
gated MLP, head_dim 256 in the published shapes, tied embeddings. Gemma 2 adds norms after attention and around
the MLP, attention scale query_pre_attn_scalar^-0.5, attention logit softcapping (in the attention kernels), the
final logit softcap (CausalLM.compute_logits) and sliding-window attention on alternate layers (`layer_types`).
Gemma 3 drops the softcaps, adds RMSNorm on each q/k head, slides on 5 of 6 layers and gives the sliding layers
their own RoPE base (`rope_local_base_freq`).
"""

from __future__ import annotations

from torch import nn

from vserve.core.layers.mlp import GatedMLP
from vserve.core.layers.norm import GemmaRMSNorm
from vserve.core.layers.quantization import QuantConfig
from vserve.core.layers.rotary import RotaryEmbedding
from vserve.core.model_config import ModelConfig
from vserve.core.models.base import CausalLM, DecoderModel
from vserve.core.models.llama import LlamaForCausalLM, QKVAttention


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        local = cfg.rope_local_theta is not None and cfg.layer_window(layer) is not None  # Gemma 3's sliding layers
        theta, scaling = (cfg.rope_local_theta, cfg.rope_local_scaling) if local else (cfg.rope_theta,
                                                                                       cfg.rope_scaling)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, scaling)
        scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
        norms = dict(q_norm=GemmaRMSNorm(cfg.head_dim, eps), k_norm=GemmaRMSNorm(cfg.head_dim, eps)) \
            if cfg.qk_norm else {}
        self.self_attn = QKVAttention(cfg, layer, quant, f"{prefix}.self_attn", rotary=rotary, scale=scale, **norms)
        act = "gelu_pytorch_tanh" if cfg.hidden_act == "gelu" else cfg.hidden_act  # HF's remap of old Gemma configs
        self.mlp = GatedMLP(H, cfg.intermediate_size, act, quant, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(H, eps)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps)
        self.sandwich = cfg.architecture != "GemmaForCausalLM"  # Gemma 2/3: norms after attention and the MLP
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(H, eps)

    def forward(self, positions, x, residual, md):
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, md)
        if not self.sandwich:  # Gemma 1: Llama's order (post_attention_layernorm is the MLP's input norm)
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(CausalLM):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__(cfg, quant_config)
        self.model = DecoderModel(cfg, lambda i, prefix: GemmaDecoderLayer(cfg, i, quant_config, prefix),
                                  lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                                  embed_scale=cfg.hidden_size ** 0.5)
        self.make_lm_head()
