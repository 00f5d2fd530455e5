"""StarCoder2 (`Starcoder2ForCausalLM`): Llama's attention with biases on every projection, LayerNorm with bias
(torch's) before attention and the MLP, a plain (not gated) c_fc -> GELU-tanh -> c_proj MLP with biases, tied
embeddings, and a sliding window on every layer where the config sets one."""

from __future__ import annotations

from torch import nn

from vserve.core.layers.mlp import MLP
from vserve.core.layers.norm import LayerNorm
from vserve.core.layers.quantization import QuantConfig
from vserve.core.model_config import ModelConfig
from vserve.core.models.base import CausalLM, DecoderModel
from vserve.core.models.llama import QKVAttention, llama_rotary


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = QKVAttention(cfg, layer, quant, f"{prefix}.self_attn", rotary=llama_rotary(cfg),
                                      bias=cfg.use_bias, o_bias=cfg.use_bias)
        self.mlp = MLP(H, cfg.intermediate_size, cfg.hidden_act, cfg.use_bias, quant, f"{prefix}.mlp")
        self.input_layernorm = LayerNorm(H, eps, bias=True)
        self.post_attention_layernorm = LayerNorm(H, eps, bias=True)

    def forward(self, positions, x, residual, md):
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x, md), residual)
        return self.mlp(x), residual


class Starcoder2ForCausalLM(CausalLM):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__(cfg, quant_config)
        self.model = DecoderModel(cfg, lambda i, prefix: Starcoder2DecoderLayer(cfg, i, quant_config, prefix),
                                  lambda: LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=True))
        self.make_lm_head()
