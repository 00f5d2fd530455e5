"""Model shapes for planning: a ModelConfig from any served config.json (MoE included) or a well-known name."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from vserve.core.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

# Planned but not served (yet): their dense part is Llama-like, the MoE part is read from the raw config.
PLANNING_ARCHITECTURES = tuple(SUPPORTED_ARCHITECTURES)


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    shared_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert; DeepSeek's n_shared_experts together
    dense_layers: int = 0  # layers with a dense MLP instead (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers)


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-head latent attention: the KV cache holds kv_lora_rank + rope_dim per token and layer."""

    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    q_lora_rank: int | None


def _llama(vocab, hidden, inter, layers, heads, kv, ctx, arch="LlamaForCausalLM", **extra) -> dict:
    return {"architectures": [arch], "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "max_position_embeddings": ctx, "torch_dtype": "bfloat16", **extra}


_GEMMA2 = dict(tie_word_embeddings=True, sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
               final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")

_DEEPSEEK_V2_LITE = dict(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
                         first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0,
                         rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                       "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})
_DEEPSEEK_V3 = dict(_DEEPSEEK_V2_LITE, q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1,
                    num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3, n_group=8,
                    topk_group=4, topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5,
                    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                  "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})

# config.json fields of published checkpoints (the shapes the seeds and the profiles talk about).
KNOWN_SHAPES: dict[str, dict] = {
    "smollm2-135m": _llama(49152, 576, 1536, 30, 9, 3, 8192, tie_word_embeddings=True),
    "llama-2-7b": _llama(32000, 4096, 11008, 32, 32, 32, 4096, torch_dtype="float16"),
    "llama-2-13b": _llama(32000, 5120, 13824, 40, 40, 40, 4096, torch_dtype="float16"),
    "llama-2-70b": _llama(32000, 8192, 28672, 80, 64, 8, 4096, torch_dtype="float16"),
    "llama-3.1-8b": _llama(128256, 4096, 14336, 32, 32, 8, 131072, rope_theta=500000.0),
    "llama-3.1-70b": _llama(128256, 8192, 28672, 80, 64, 8, 131072, rope_theta=500000.0),
    "mistral-7b": _llama(32768, 4096, 14336, 32, 32, 8, 32768, "MistralForCausalLM", rope_theta=1e6),
    "qwen2.5-7b": _llama(152064, 3584, 18944, 28, 28, 4, 32768, "Qwen2ForCausalLM"),
    "qwen2.5-14b": _llama(152064, 5120, 13824, 48, 40, 8, 32768, "Qwen2ForCausalLM"),
    "qwen2.5-32b": _llama(152064, 5120, 27648, 64, 40, 8, 32768, "Qwen2ForCausalLM"),
    "qwen2.5-72b": _llama(152064, 8192, 29568, 80, 64, 8, 32768, "Qwen2ForCausalLM"),
    "qwen3-8b": _llama(151936, 4096, 12288, 36, 32, 8, 40960, "Qwen3ForCausalLM", head_dim=128),
    "yi-34b": _llama(64000, 7168, 20480, 60, 56, 8, 4096),
    "mixtral-8x7b": _llama(32000, 4096, 14336, 32, 32, 8, 32768, "MixtralForCausalLM", num_local_experts=8,
                           num_experts_per_tok=2, rope_theta=1e6),
    "qwen1.5-moe-a2.7b": _llama(151936, 2048, 5632, 24, 16, 16, 8192, "Qwen2MoeForCausalLM", num_experts=60,
                                num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                rope_theta=1e6),
    "qwen3-30b-a3b": _llama(151936, 2048, 6144, 48, 32, 4, 40960, "Qwen3MoeForCausalLM", head_dim=128, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1e6),
    "deepseek-v2-lite": _llama(102400, 2048, 10944, 27, 16, 16, 163840, "DeepseekV2ForCausalLM", **_DEEPSEEK_V2_LITE),
    "deepseek-v3": _llama(129280, 7168, 18432, 61, 128, 128, 163840, "DeepseekV3ForCausalLM", **_DEEPSEEK_V3),
    "deepseek-llm-7b": _llama(102400, 4096, 11008, 30, 32, 32, 4096),
    "deepseek-llm-67b": _llama(102400, 8192, 22016, 95, 64, 8, 4096),
    "gemma-7b": _llama(256000, 3072, 24576, 28, 16, 16, 8192, "GemmaForCausalLM", head_dim=256,
                       tie_word_embeddings=True),
    "gemma-2-9b": _llama(256000, 3584, 14336, 42, 16, 8, 8192, "Gemma2ForCausalLM", head_dim=256, **_GEMMA2),
    "gemma-2-27b": _llama(256000, 4608, 36864, 46, 32, 16, 8192, "Gemma2ForCausalLM", head_dim=128,
                          **{**_GEMMA2, "query_pre_attn_scalar": 144}),
    "gemma-3-1b": _llama(262144, 1152, 6912, 26, 4, 1, 32768, "Gemma3ForCausalLM", head_dim=256,
                         tie_word_embeddings=True, sliding_window=512, query_pre_attn_scalar=256,
                         rope_local_base_freq=10000.0, rope_theta=1e6),
    "phi-3-mini": _llama(32064, 3072, 8192, 32, 32, 32, 4096, "Phi3ForCausalLM", sliding_window=2047),
    "phi-3-mini-128k": _llama(32064, 3072, 8192, 32, 32, 32, 131072, "Phi3ForCausalLM", sliding_window=262144,
                              original_max_position_embeddings=4096,
                              rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                                            "long_factor": [1.0] * 48}),
    "phi-3-medium": _llama(32064, 5120, 17920, 40, 40, 10, 4096, "Phi3ForCausalLM", sliding_window=2047),
    "phi-4-mini": _llama(200064, 3072, 8192, 32, 24, 8, 131072, "Phi3ForCausalLM", partial_rotary_factor=0.75,
                         tie_word_embeddings=True),
    "command-r-35b": _llama(256000, 8192, 22528, 40, 64, 64, 131072, "CohereForCausalLM", logit_scale=0.0625,
                            rope_theta=8e6, tie_word_embeddings=True),
    "command-r7b": _llama(256000, 4096, 14336, 32, 32, 8, 131072, "Cohere2ForCausalLM", logit_scale=0.25,
                          sliding_window=4096, tie_word_embeddings=True, rope_theta=50000.0),
    "starcoder2-15b": _llama(49152, 6144, 24576, 40, 48, 4, 16384, "Starcoder2ForCausalLM", sliding_window=4096,
                             use_bias=True, hidden_act="gelu_pytorch_tanh", rope_theta=100000.0),
}


def planning_config(cfg: dict) -> ModelConfig:
    """A ModelConfig for planning: what ModelConfig.from_dict serves, plus the PLANNING_ARCHITECTURES."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in PLANNING_ARCHITECTURES), None)
    if arch is None or arch in SUPPORTED_ARCHITECTURES:
        return ModelConfig.from_dict(cfg)
    return replace(ModelConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"]}), architecture=arch,
                   raw=cfg)


def known_shape(name: str) -> ModelConfig:
    if name not in KNOWN_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(KNOWN_SHAPES)}")
    return planning_config(KNOWN_SHAPES[name])


def read_model_config(model: str | Path) -> ModelConfig:
    """A model folder, a config.json file, a KNOWN_SHAPES name or a hub id (GGUF files: see ops/doctor.py)."""
    if isinstance(model, str) and model in KNOWN_SHAPES:
        return known_shape(model)
    p = Path(model)
    if isinstance(model, str) and not p.exists():
        from vserve.core.hub import HubModel, config_file

        if HubModel.parse(model) is not None:  # a hub id: its config.json from the cache, or that file alone
            p = config_file(model)
    file = p / "config.json" if p.is_dir() else p
    if not file.exists():
        raise ValueError(f"model {str(model)!r} is not a folder with config.json, a config.json file or a known "
                         f"shape ({', '.join(KNOWN_SHAPES)})")
    try:
        return planning_config(json.loads(file.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    except KeyError as e:
        raise ValueError(f"{file} lacks the field {e.args[0]!r}") from None


def moe_shape(m: ModelConfig) -> MoEShape | None:
    raw = m.raw
    experts = raw.get("num_local_experts") or raw.get("num_experts") or raw.get("n_routed_experts")
    if not experts:
        return None
    inter = int(raw.get("moe_intermediate_size") or m.intermediate_size)
    L = m.num_hidden_layers
    if "n_routed_experts" in raw:  # DeepSeek
        shared = inter * int(raw.get("n_shared_experts") or 0)
        dense = min(L, int(raw.get("first_k_dense_replace") or 0))
    else:  # Qwen-MoE's sparse layers: not in mlp_only_layers and (i + 1) a multiple of decoder_sparse_step
        step, only = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or [])
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
        dense = sum(1 for i in range(L) if i in only or (i + 1) % step)
    return MoEShape(num_experts=int(experts), top_k=int(raw.get("num_experts_per_tok") or 2),
                    intermediate_size=inter, shared_intermediate_size=shared, dense_layers=dense)


def mla_shape(m: ModelConfig) -> MLAShape | None:
    raw = m.raw
    if not raw.get("kv_lora_rank"):
        return None
    return MLAShape(int(raw["kv_lora_rank"]), int(raw["qk_rope_head_dim"]), int(raw["qk_nope_head_dim"]),
                    int(raw["v_head_dim"]), raw.get("q_lora_rank"))
