"""Command R / R+ (`CohereForCausalLM`) and Command R7B (`Cohere2ForCausalLM`).

One LayerNorm (no bias, mean subtracted) feeds attention and the MLP in parallel, both added to the same residual;
RoPE rotates interleaved pairs (GPT-J style); the logits are multiplied by `logit_scale`; Command R+ normalizes
each q/k head with its own LayerNorm weights (`use_qk_norm`). Command R7B slides a window on 3 of 4 layers and
gives the others no positional encoding at all (RoPE on the sliding layers only).
"""

from __future__ import annotations

import torch
from torch import nn

from vserve.core.distributed import get_tp_rank, get_tp_size
from vserve.core.layers.mlp import GatedMLP
from vserve.core.layers.norm import LayerNorm
from vserve.core.layers.quantization import QuantConfig
from vserve.core.layers.rotary import RotaryEmbedding
from vserve.core.model_config import ModelConfig
from vserve.core.models.base import CausalLM, DecoderModel
from vserve.core.models.llama import LlamaForCausalLM, QKVAttention, kv_head_parts


def head_norm(heads: int, d: int, eps: float, parts: int) -> LayerNorm:
    """Per-head LayerNorm weights [heads, d] of this rank's heads: rows of the checkpoint's [all heads, d], the
    heads cut into `parts` slices over the TP ranks (as the packed qkv projection cuts them)."""
    local = max(1, heads // get_tp_size())
    norm = LayerNorm((local, d), eps)
    index = get_tp_rank() * parts // get_tp_size()

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (heads, d):
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {(heads, d)}")
        param.data.copy_(loaded[index * local:(index + 1) * local])

    norm.weight.weight_loader = load
    return norm


class CohereDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        eps, d = cfg.rms_norm_eps, cfg.head_dim
        r7b = cfg.architecture == "Cohere2ForCausalLM"
        rotary = None if r7b and cfg.layer_window(layer) is None else RotaryEmbedding(
            d, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, interleaved=True)
        norms = {}
        if cfg.qk_norm:
            norms = dict(q_norm=head_norm(cfg.num_attention_heads, d, eps, get_tp_size()),
                         k_norm=head_norm(cfg.num_key_value_heads, d, eps, kv_head_parts(cfg.num_key_value_heads)))
        self.self_attn = QKVAttention(cfg, layer, quant, f"{prefix}.self_attn", rotary=rotary,
                                      o_bias=cfg.attention_bias, **norms)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, quant, f"{prefix}.mlp")
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps)

    def forward(self, positions, x, residual, md):
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        return self.self_attn(positions, h, md) + self.mlp(h), residual  # parallel blocks off one norm


class CohereForCausalLM(CausalLM):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__(cfg, quant_config)
        self.model = DecoderModel(cfg, lambda i, prefix: CohereDecoderLayer(cfg, i, quant_config, prefix),
                                  lambda: LayerNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_lm_head()
