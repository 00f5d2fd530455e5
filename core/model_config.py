"""The model's architecture, read from an HF config.json (transformers 4 and 5 conventions alike), and where a model
argument points (an HF folder or a GGUF file): torch-free, so the front end reads it without importing the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vserve.ops.assets import default_model_path

if TYPE_CHECKING:
    from vserve.core.config import EngineConfig

# architectures in config.json -> the implementation that serves them
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen_moe",
    "Qwen3MoeForCausalLM": "qwen_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v2",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Phi3ForCausalLM": "phi3",
    "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere",
    "Starcoder2ForCausalLM": "starcoder2",
}

# Without layer_types in config.json: every n-th layer attends globally, the others slide (transformers' defaults).
_SLIDING_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "Cohere2ForCausalLM": 4}
_DEFAULT_THETA = {"Gemma3ForCausalLM": 1_000_000.0, "CohereForCausalLM": 500_000.0}


def _rope(params: dict | None, scaling: dict | None, theta: float | None) -> tuple[float | None, dict | None]:
    """(theta, scaling dict or None for plain RoPE) from transformers 5's rope_parameters or 4's rope_scaling;
    Phi-3's old names su/yarn (with short and long factors) mean longrope."""
    params = dict(params or {})
    theta = params.pop("rope_theta", None) or theta
    if params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    if scaling is None:
        return theta, None
    scaling = dict(scaling)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "su" or (kind == "yarn" and "short_factor" in scaling):
        kind = "longrope"
    scaling["rope_type"] = kind
    return theta, None if kind == "default" else scaling


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
    hidden_act: str = "silu"
    # per layer "sliding_attention" or "full_attention"; None: every layer slides when sliding_window is set
    layer_types: list[str] | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the LM head's logits
    query_pre_attn_scalar: float | None = None  # Gemma 2/3: attention scale query_pre_attn_scalar^-0.5
    logit_scale: float | None = None  # Command R: logits multiplied by it
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim x factor dims only (Phi-4-mini)
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers
    rope_local_scaling: dict | None = None
    use_bias: bool = False  # StarCoder2: every linear layer carries a bias
    raw: dict = field(default_factory=dict, repr=False)

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (tokens a query sees, itself included), None where it attends to everything."""
        if self.sliding_window is None or (self.layer_types is not None and
                                           self.layer_types[i] != "sliding_attention"):
            return None
        return self.sliding_window

    def kv_window(self) -> int | None:
        """The window when every layer slides (KV blocks older than it are never read again), else None."""
        windows = [self.layer_window(i) for i in range(self.num_hidden_layers)]
        return None if None in windows else max(windows)

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
        # transformers 5 nests rope settings in rope_parameters (per layer type for Gemma 3); 4 has rope_theta +
        # rope_scaling (+ rope_local_base_freq).
        params = cfg.get("rope_parameters") or {}
        local_params = params.get("sliding_attention")
        if "full_attention" in params:
            params = params["full_attention"]
        theta, rope_scaling = _rope(params, cfg.get("rope_scaling"),
                                    cfg.get("rope_theta") or _DEFAULT_THETA.get(arch, 10000.0))
        local_theta, local_scaling = _rope(local_params, None, cfg.get("rope_local_base_freq"))
        if local_theta is None and arch == "Gemma3ForCausalLM":
            local_theta = 10000.0
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            rope_scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            window = None
        layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types")
        if layer_types is None and arch in _SLIDING_PATTERN:
            n = cfg.get("sliding_window_pattern") or _SLIDING_PATTERN[arch]
            layer_types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
        gemma = arch.startswith("Gemma")
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps") or cfg.get("layer_norm_eps") or cfg.get("norm_epsilon") or 1e-6,
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma or arch.startswith(("Cohere", "Star")))),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM") or cfg.get("use_bias")
                                or (arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
            or bool(cfg.get("use_qk_norm")),
            sliding_window=window,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            num_experts=cfg.get("num_local_experts", 0),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            layer_types=list(layer_types) if layer_types is not None else None,
            # Gemma 3's config may carry one, but its attention never applies it (transformers' modeling_gemma3)
            attn_logit_softcapping=None if arch == "Gemma3ForCausalLM" else cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            logit_scale=cfg.get("logit_scale"),
            partial_rotary_factor=float((params or {}).get("partial_rotary_factor") or
                                        cfg.get("partial_rotary_factor") or 1.0),
            rope_local_theta=local_theta,
            rope_local_scaling=local_scaling,
            use_bias=bool(cfg.get("use_bias", False)),
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
        if self.raw.get("kv_lora_rank"):  # MLA: the compressed latent (core/memory.py kv_bytes_per_token)
            return self.num_hidden_layers * (self.raw["kv_lora_rank"] + self.raw["qk_rope_head_dim"]) * dtype_bytes
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def resolve_model(model: str, load_format: str) -> tuple[Path, str]:
    """(path, format) for a model argument: an HF folder, a .gguf file, or a folder holding one."""
    p = Path(model).expanduser()
    if not p.exists():
        raise ValueError(f"model path {model!r} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"{model!r} is a file but not a .gguf; pass an HF model folder or a GGUF file")
        return p, "gguf" if load_format == "auto" else load_format
    if load_format in ("auto", "gguf") and not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0], "gguf"
    if load_format == "gguf":
        raise ValueError(f"--load-format gguf needs a .gguf file or a folder with exactly one, got {model!r}")
    if not (p / "config.json").exists():
        raise ValueError(f"no config.json in model folder {model!r}")
    if load_format == "auto":
        if not list(p.glob("*.safetensors")):
            raise ValueError(f"no .safetensors weights in {model!r} (pickled .bin weights are refused)")
        return p, "safetensors"
    return p, load_format


def model_source(config: EngineConfig) -> tuple[Path, str, ModelConfig]:
    """(path, format, model config) of config.model (a local path; the embedded default model when unset)."""
    path, fmt = resolve_model(config.model or str(default_model_path()), config.load_format)
    if fmt == "gguf":
        from vserve.core.gguf_file import gguf_config

        return path, fmt, ModelConfig.from_dict(gguf_config(path))
    return path, fmt, ModelConfig.from_pretrained(path)


BERT_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")


def is_embedding_model(path: str | Path) -> bool:
    """True when the folder's config.json names a BERT encoder (architectures, or model_type when none)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = cfg.get("architectures") or []
    if archs:
        # a BertForSequenceClassification (cross-encoder) scores pairs; it is not an embedding model
        return any(a in BERT_ARCHITECTURES for a in archs)
    return cfg.get("model_type") == "bert"
