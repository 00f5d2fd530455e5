"""DeepSeek-V2 / V2-Lite / V3: multi-head latent attention (MLA) and DeepSeekMoE.

MLA: q from hidden directly or through a low-rank q_a_proj -> RMSNorm -> q_b_proj (q_lora_rank); one shared
kv_a_proj_with_mqa gives the latent c (kv_lora_rank, RMSNorm'd) and a single RoPE key k_pe (qk_rope_head_dim, shared
by all heads); kv_b_proj expands c into each head's no-RoPE key (qk_nope_head_dim) and value (v_head_dim). The KV
cache holds [c | k_pe] per token and layer, not per-head keys and values (kernels/mla_ref.py: decode in the latent
space, prefill expanded). RoPE on interleaved pairs, yarn with mscale (the softmax scale times
mscale(factor, mscale_all_dim)^2). DeepSeekMoE: shared experts always on, routed experts by grouped top-k (V2
softmax, V3 sigmoid with e_score_correction_bias), times routed_scaling_factor; the first first_k_dense_replace
layers dense. Heads, expert intermediate dims and dense MLPs split over TP ranks; the latent cache is replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from vserve.core.distributed import all_reduce, shard
from vserve.core.layers.attention import AttentionMetadata
from vserve.core.layers.fused_moe import FusedMoE, grouped_top_k
from vserve.core.layers.linear import Linear
from vserve.core.layers.mlp import GatedMLP
from vserve.core.layers.norm import RMSNorm
from vserve.core.layers.quantization import QuantConfig
from vserve.core.layers.rotary import RotaryEmbedding, yarn_get_mscale
from vserve.core.model_config import ModelConfig
from vserve.core.models.base import CausalLM, DecoderModel, PreNormDecoderLayer
from vserve.kernels import for_device

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm (HF builds them with the default eps, not rms_norm_eps)


class LatentAttention(nn.Module):
    """The paged part of MLA: stores [c | k_pe] and attends over it. The model runner sees one KV head of
    kv_lora_rank + rope_dim and no separate value cache (latent_cache)."""

    latent_cache = True

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, 1, kv_lora_rank + rope_dim
        self.scale = scale
        self.sliding_window = self.logits_soft_cap = None
        self.k_cache = self.v_cache = torch.empty(0)  # k_cache: the latent cache, bound by the model runner

    def forward(self, q_nope, q_pe, latent, k_pe, w_kv, md: AttentionMetadata) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope], latent [T, r], k_pe [T, rope], w_kv [H, nope + v, r] -> [T, H, v]."""
        ops = for_device(q_nope)
        ops.store_latent(latent, k_pe, self.k_cache, md.slot_mapping)
        nd, T = md.num_decodes, q_nope.shape[0]
        if nd == T:
            return ops.mla_decode_attention(q_nope, q_pe, self.k_cache, md.block_tables, md.context_lens, w_kv,
                                            self.scale)
        out = q_nope.new_empty(T, q_nope.shape[1], w_kv.shape[1] - q_nope.shape[2])
        if nd:
            out[:nd] = ops.mla_decode_attention(q_nope[:nd], q_pe[:nd], self.k_cache, md.block_tables[:nd],
                                                md.context_lens[:nd], w_kv, self.scale)
        out[nd:] = ops.mla_prefill_attention(q_nope[nd:], q_pe[nd:], self.k_cache, md.cu_seqlens_q,
                                             md.context_lens[nd:], md.block_tables[nd:], w_kv, self.scale)
        return out


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, prefix: str) -> None:
        super().__init__()
        raw = cfg.raw
        H, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.h = shard(H, "attention heads")
        self.q_lora_rank, self.kv_lora_rank = raw.get("q_lora_rank"), raw["kv_lora_rank"]
        self.nope, self.rope, self.v = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
        qk = self.nope + self.rope
        bias = bool(raw.get("attention_bias", False))
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, H * qk, parallel="column")
        else:
            self.q_proj = Linear(hidden, H * qk, parallel="column")
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, H * (self.nope + self.v), parallel="column")
        self.o_proj = Linear(H * self.v, hidden, bias=bias, parallel="row")
        scaling = cfg.rope_scaling
        self.rotary_emb = RotaryEmbedding(self.rope, cfg.max_position_embeddings, cfg.rope_theta, scaling)
        # V2's complex rotation keeps the pairs interleaved in its output; V3 (rope_interleave) writes the rotated
        # evens then odds, as does rotate-half without interleaving: q_pe . k_pe is the same, the rounding too
        self.pairs_out = cfg.architecture == "DeepseekV2ForCausalLM"
        self.pairs_in = self.pairs_out or raw.get("rope_interleave", True)
        scale = qk ** -0.5
        if scaling is not None and scaling["rope_type"] == "yarn" and scaling.get("mscale_all_dim"):
            scale *= yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        self.attn = LatentAttention(self.h, self.kv_lora_rank, self.rope, scale)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, rope] rotated in fp32 and rounded once (the table carries yarn's attention factor)."""
        c = self.rotary_emb.cos[positions].unsqueeze(1)
        s = self.rotary_emb.sin[positions].unsqueeze(1)
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if self.pairs_in else x.chunk(2, dim=-1)
        x1, x2 = x1.float(), x2.float()
        a, b = x1 * c - x2 * s, x2 * c + x1 * s
        return (torch.stack((a, b), -1).flatten(-2) if self.pairs_out else torch.cat((a, b), -1)).to(x.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(T, self.h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotate(positions, q_pe), self.rotate(positions, k_pe.unsqueeze(1)).squeeze(1)
        w_kv = self.kv_b_proj.weight.view(self.h, self.nope + self.v, self.kv_lora_rank)
        o = self.attn(q_nope, q_pe, latent, k_pe, w_kv, md)
        return self.o_proj(o.reshape(T, self.h * self.v))


class DeepseekMoE(nn.Module):
    """Routed experts (grouped top-k) plus the shared experts (one MLP of n_shared_experts x moe_intermediate_size).
    The router's weight and V3's correction bias stay in fp32, as HF keeps them."""

    def __init__(self, cfg: ModelConfig, prefix: str) -> None:
        super().__init__()
        raw = cfg.raw
        E, inter = raw["n_routed_experts"], raw["moe_intermediate_size"]
        self.v3 = cfg.architecture == "DeepseekV3ForCausalLM"
        self.top_k, self.scaling = raw["num_experts_per_tok"], float(raw.get("routed_scaling_factor") or 1.0)
        grouped = self.v3 or raw.get("topk_method") == "group_limited_greedy"
        self.num_group, self.topk_group = (raw.get("n_group") or 1, raw.get("topk_group") or 1) if grouped else (1, 1)
        if E % self.num_group:
            raise ValueError(f"n_group {self.num_group} must divide n_routed_experts {E}")
        self.renormalize = self.v3 and bool(raw.get("norm_topk_prob"))  # HF's V2 router never renormalizes
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=torch.float32), requires_grad=False)
        if self.v3:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32),
                                                             requires_grad=False)
        self.experts = FusedMoE(E, cfg.hidden_size, inter)
        n_shared = raw.get("n_shared_experts") or 0
        self.shared_experts = GatedMLP(cfg.hidden_size, inter * n_shared, cfg.hidden_act, None,
                                       f"{prefix}.shared_experts") if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(x.float(), self.gate.weight)
        weights, ids = grouped_top_k(logits, self.top_k, scoring="sigmoid" if self.v3 else "softmax",
                                     num_group=self.num_group, topk_group=self.topk_group,
                                     group_score="top2" if self.v3 else "max",
                                     correction_bias=self.gate.e_score_correction_bias if self.v3 else None,
                                     renormalize=self.renormalize, scaling=self.scaling)
        out = all_reduce(self.experts(x, weights.to(x.dtype), ids))
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, prefix: str) -> None:
        super().__init__()
        self.self_attn = MLAAttention(cfg, layer, f"{prefix}.self_attn")
        dense = layer < (cfg.raw.get("first_k_dense_replace") or 0) or not cfg.raw.get("n_routed_experts")
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, None, f"{prefix}.mlp") if dense \
            else DeepseekMoE(cfg, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV2ForCausalLM(CausalLM):
    # decode steps run eagerly until the MLA decode path (kernels/triton_mla.py, host-sync free) has been captured in
    # a CUDA graph on a GPU (benchmarks/kernels/mla_decode.py checks and times it)
    cuda_graphs = False
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        if quant_config is not None:
            raise ValueError("quantized DeepSeek checkpoints are not served yet")
        if cfg.raw.get("mlp_bias"):
            raise ValueError("DeepSeek configs with mlp_bias are not served (no published checkpoint has it)")
        super().__init__(cfg, quant_config)
        self.model = DecoderModel(cfg, lambda i, prefix: DeepseekDecoderLayer(cfg, i, prefix),
                                  lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.make_lm_head()
