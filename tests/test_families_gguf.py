"""The llama.cpp architectures gemma, gemma2, gemma3, phi3, command-r, cohere2 and starcoder2 load from GGUF: a tiny
random HF model converted the way llama.cpp's convert_hf_to_gguf.py does (the `gguf` package's tensor names and
writer, Gemma's norms stored as 1 + w, Phi-3's LongRoPE factors as tensors) gives HF's greedy tokens."""

import json
import os
import random

import pytest

from vserve import LLM, SamplingParams

WINDOW = 24

# gguf architecture -> (transformers config class, overrides): each with the features its GGUF must carry
CASES = {
    "gemma": ("GemmaConfig", dict(head_dim=32)),
    "gemma2": ("Gemma2Config", dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=WINDOW, num_hidden_layers=7,
                                        query_pre_attn_scalar=32, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW, partial_rotary_factor=0.5, original_max_position_embeddings=256,
                                rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(4)],
                                              "long_factor": [2.0 + i for i in range(4)]})),
    "command-r": ("CohereConfig", dict(use_qk_norm=True, logit_scale=0.5)),
    "cohere2": ("Cohere2Config", dict(sliding_window=WINDOW, num_hidden_layers=4, logit_scale=0.5)),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=WINDOW)),
}


def hf_to_gguf(folder, arch: str, out) -> None:
    """convert_hf_to_gguf.py's output for these architectures, F32 tensors."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    L, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(rope["rope_theta"])
    if "rms_norm_eps" in cfg:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    else:
        w.add_layer_norm_eps(cfg.get("layer_norm_eps") or cfg["norm_epsilon"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("attn_logit_softcapping"):
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("logit_scale"):
        w.add_logit_scale(cfg["logit_scale"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    tensors = load_file(folder / "model.safetensors")
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), L)
    for name, data in tensors.items():
        base, suffix = name.rsplit(".", 1)
        target = name if name.startswith("rope_factors") else f"{names.get_name(base)}.{suffix}"
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0
        w.add_tensor(target, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_of_the_family_matches_hf(tmp_path, default_model_dir, arch):
    from test_families import TINY, build_tiny, hf_greedy

    seed = int.from_bytes(os.urandom(4), "little")
    cls_name, overrides = CASES[arch]
    build_tiny(tmp_path, cls_name, overrides, seed, default_model_dir)
    hf_to_gguf(tmp_path, arch, tmp_path / "tiny.gguf")
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in (9, 40)]
    expected = hf_greedy(tmp_path, prompts, 12)
    llm = LLM(str(tmp_path / "tiny.gguf"), tokenizer=str(default_model_dir), dtype="float32", device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected, f"model seed {seed}"
