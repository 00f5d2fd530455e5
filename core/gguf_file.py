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
                      "starcoder2": "Starcoder2ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "deepseek2": "DeepseekV2ForCausalLM"}
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
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_ARCH_LAYER_NAMES["qwen2moe"] = _ARCH_LAYER_NAMES["qwen3moe"] = _MOE_NAMES
_ARCH_LAYER_NAMES["deepseek2"] = {
    **_MOE_NAMES, "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj", "exp_probs_b": "mlp.gate.e_score_correction",
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj"}
# stacked experts [E, ...] in the file -> one tensor per expert under HF's per-expert names
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
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
    if arch in ("qwen2moe", "qwen3moe", "deepseek2"):
        extra.update(_moe_config(arch, a, names))
    if arch == "deepseek2":
        extra.update(_mla_config(a, names))
    return {
        "architectures": [extra.pop("architecture", GGUF_ARCHITECTURES[arch])],
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


def _moe_config(arch: str, a, names: set[str]) -> dict:
    """The MoE fields; a layer without stacked experts in the file is dense (Qwen's mlp_only_layers, DeepSeek's
    first layers). llama.cpp renormalizes Qwen3-MoE's top-k weights and not Qwen2-MoE's unless the file says."""
    layers = a("block_count")
    sparse = [f"blk.{i}.ffn_gate_exps.weight" in names for i in range(layers)]
    cfg = {"num_experts_per_tok": a("expert_used_count"), "moe_intermediate_size": a("expert_feed_forward_length"),
           "norm_topk_prob": bool(a("expert_weights_norm", arch == "qwen3moe"))}
    if arch == "deepseek2":
        gating = a("expert_gating_func", 1)  # llama.cpp: 1 softmax, 2 sigmoid (V3)
        groups = a("expert_group_count", 1) or 1
        cfg.update(n_routed_experts=a("expert_count"), n_shared_experts=a("expert_shared_count", 0),
                   first_k_dense_replace=a("leading_dense_block_count", 0),
                   routed_scaling_factor=float(a("expert_weights_scale", 1.0)), n_group=groups,
                   topk_group=a("expert_group_used_count", 1) or 1,
                   topk_method="noaux_tc" if gating == 2 else ("group_limited_greedy" if groups > 1 else "greedy"))
        if gating == 2:
            cfg["architecture"] = "DeepseekV3ForCausalLM"
        return cfg
    cfg.update(num_experts=a("expert_count"), decoder_sparse_step=1,
               mlp_only_layers=[i for i, s in enumerate(sparse) if not s])
    if arch == "qwen2moe":
        cfg.update(shared_expert_intermediate_size=a("expert_shared_feed_forward_length", 0),
                   qkv_bias="blk.0.attn_q.bias" in names)
    return cfg


def _mla_config(a, names: set[str]) -> dict:
    """DeepSeek's MLA fields. llama.cpp's key/value lengths are those of the expanded heads (key_length_mla /
    value_length_mla where the file also has the latent's). Yarn: llama.cpp keeps 0.1 x mscale_all_dim as
    yarn_log_multiplier and not mscale; it is taken equal to mscale_all_dim (every published DeepSeek config)."""
    rope = a("rope.dimension_count")
    key, value = a("attention.key_length_mla") or a("attention.key_length"), \
        a("attention.value_length_mla") or a("attention.value_length")
    cfg = {"kv_lora_rank": a("attention.kv_lora_rank"), "q_lora_rank": a("attention.q_lora_rank") or None,
           "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope, "v_head_dim": value, "head_dim": rope,
           "rope_interleave": True}
    if a("rope.scaling.type") == "yarn":
        mscale = (a("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": float(a("rope.scaling.factor")),
                               "original_max_position_embeddings": a("rope.scaling.original_context_length"),
                               "mscale": mscale, "mscale_all_dim": mscale}
    return cfg


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
    k_b: dict[str, np.ndarray] = {}  # DeepSeek's kv_b_proj split by llama.cpp into k_b and v_b: waiting for v_b
    for t in r.tensors:
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            continue  # Phi-3's LongRoPE factors: in the config (gguf_config)
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        stacked = re.fullmatch(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight", t.name)
        if stacked is not None:  # [E, out, in]: one tensor per expert
            for e in range(w.shape[0]):
                yield (f"model.layers.{stacked.group(1)}.mlp.experts.{e}.{_EXPERTS[stacked.group(2)]}.weight",
                       torch.from_numpy(np.array(w[e])).to(dtype))  # a copy: F32 tensors map the file
            continue
        split = re.fullmatch(r"blk\.(\d+)\.attn_([kv])_b\.weight", t.name)
        if split is not None:  # k_b [H, r, nope], v_b [H, v, r] -> kv_b_proj [H * (nope + v), r]
            k_b[split.group(1) + split.group(2)] = w
            kb, vb = k_b.pop(split.group(1) + "k", None), k_b.pop(split.group(1) + "v", None)
            if kb is None or vb is None:
                k_b.update({split.group(1) + x: y for x, y in (("k", kb), ("v", vb)) if y is not None})
                continue
            w = np.concatenate((kb.transpose(0, 2, 1), vb), axis=1).reshape(-1, kb.shape[1])
            yield f"model.layers.{split.group(1)}.self_attn.kv_b_proj.weight", torch.from_numpy(w).to(dtype)
            continue
        name = _hf_name(t.name, arch)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in {cfg['architectures'][0]}")
        name = name.replace(".e_score_correction.bias", ".e_score_correction_bias")  # DeepSeek-V3's exp_probs_b
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
