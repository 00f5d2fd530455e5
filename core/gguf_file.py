"""GGUF checkpoints through the `gguf` package: HF config from metadata, dequantized tensors under HF names.

What llama.cpp's convert_hf_to_gguf.py changed is undone here: Llama's q/k rows interleaved for its RoPE, Gemma's
norm weights stored as 1 + w, Phi-3's LongRoPE factors stored as tensors; what it dropped is restored the way
llama.cpp itself decides it (Gemma 2/3's attention scale, Gemma 3's local RoPE base and layer pattern)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "command-r": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM",
                      "starcoder2": "Starcoder2ForCausalLM"}
GEMMAS = ("gemma", "gemma2", "gemma3")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# where an architecture's block tensors differ from Llama's
_ARCH_LAYER_NAMES = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "starcoder2": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_DEFAULTS = {  # config.json fields the GGUF metadata does not carry, as transformers' configs default them
    "gemma": {"hidden_act": "gelu_pytorch_tanh"},
    "gemma2": {"hidden_act": "gelu_pytorch_tanh"},
    "gemma3": {"hidden_act": "gelu_pytorch_tanh", "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6},
    "starcoder2": {"hidden_act": "gelu_pytorch_tanh"},
    "cohere2": {"sliding_window_pattern": 4},
}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales their attention by (hidden / heads)^-0.5


def _reader(path: str | Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: str | Path, reader=None) -> dict:
    """An HF-style config.json dict built from the GGUF metadata."""
    r = reader or _reader(path)
    arch = _field(r, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    names = {t.name for t in r.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with rope_freqs (llama3 rope scaling) are not supported yet")

    def a(key, default=None):
        return _field(r, f"{arch}.{key}", default)

    heads = a("attention.head_count")
    hidden = a("embedding_length")
    vocab = a("vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data)
    head_dim = a("attention.key_length", hidden // heads)
    extra = dict(_DEFAULTS.get(arch, {}))
    eps = a("attention.layer_norm_rms_epsilon") or a("attention.layer_norm_epsilon", 1e-6)
    for key, field in (("attention.sliding_window", "sliding_window"), ("logit_scale", "logit_scale"),
                       ("attn_logit_softcapping", "attn_logit_softcapping"),
                       ("final_logit_softcapping", "final_logit_softcapping")):
        if a(key) is not None:
            extra[field] = a(key)
    if arch in ("gemma2", "gemma3"):
        big = a("block_count") == _LAYERS_27B[arch]
        extra["query_pre_attn_scalar"] = hidden // heads if big else head_dim
    if arch == "gemma3" and a("rope.scaling.type") == "linear":
        extra["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    if arch == "phi3":
        rot = a("rope.dimension_count", head_dim)
        extra["partial_rotary_factor"] = rot / head_dim
        if "rope_factors_long.weight" in names:  # LongRoPE: its factors are tensors in the file
            t = {t.name: t for t in r.tensors}
            extra["original_max_position_embeddings"] = a("rope.scaling.original_context_length")
            extra["rope_scaling"] = {"rope_type": "longrope",
                                     "long_factor": [float(x) for x in t["rope_factors_long.weight"].data],
                                     "short_factor": [float(x) for x in t["rope_factors_short.weight"].data]}
            if a("rope.scaling.attn_factor") is not None:
                extra["rope_scaling"]["attention_factor"] = float(a("rope.scaling.attn_factor"))
    if arch == "command-r":
        extra["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
    if arch == "starcoder2":
        extra["use_bias"] = "blk.0.attn_q.bias" in names
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": a("feed_forward_length"),
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": a("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(eps),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": a("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
        **extra,
    }


def _hf_name(name: str, arch: str = "llama") -> str | None:
    base, _, suffix = name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores llama q/k rows interleaved for its RoPE; undo that to HF's rotate-half order."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_tensor_count(path: str | Path) -> int:
    return len(_reader(path).tensors)


def iter_gguf_tensors(path: str | Path, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, dequantized tensor) for every tensor in the file."""
    from gguf.quants import dequantize

    r = _reader(path)
    cfg = gguf_config(path, r)
    arch = cfg["model_type"]
    llama = arch == "llama"
    for t in r.tensors:
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            continue  # Phi-3's LongRoPE factors: in the config (gguf_config)
        name = _hf_name(t.name, arch)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in {cfg['architectures'][0]}")
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        if llama and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            w = _unpermute(w, heads)
        if arch in GEMMAS and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's 1 + w
        w = np.ascontiguousarray(w)
        if not w.flags.writeable:  # F32/F16 tensors are views of the read-only memory map
            w = w.copy()
        yield name, torch.from_numpy(w).to(dtype)


def gguf_tokenizer(path: str | Path):
    """The HF fast tokenizer (with chat template) transformers builds from the GGUF metadata."""
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
