"""The model's architecture, read from an HF config.json (transformers 4 and 5 conventions alike)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# architectures in config.json -> the implementation that serves them
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_id: list[int] = field(default_factory=list)
    num_experts: int = 0  # sparse MoE (Mixtral): experts per layer, 0 for a dense MLP
    num_experts_per_tok: int = 0
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; vserve serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        # transformers 5 nests rope settings in rope_parameters; 4 has rope_theta + rope_scaling.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or None
        theta = rope_params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling["rope_type"] = rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            window = None
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            num_experts=cfg.get("num_local_experts", 0),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            raw=cfg,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        try:
            cfg = json.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(f"no config.json in model folder {path}") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {p}: {e}") from None
        return cls.from_dict(cfg)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
