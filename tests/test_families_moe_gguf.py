"""The llama.cpp architectures qwen2moe, qwen3moe and deepseek2 load from GGUF: a tiny random HF model converted the
way llama.cpp's convert_hf_to_gguf.py does (experts stacked per layer, DeepSeek's kv_b_proj split into per-head k_b
and v_b, V3's sigmoid gating and correction bias, yarn as its log multiplier; F32 tensors) gives HF's greedy
tokens."""

import json
import os
import random

import pytest
from test_families import TINY, hf_greedy
from test_families_moe import FAMILIES, build

from vserve import LLM, SamplingParams

_YARN_EQUAL = dict(FAMILIES["deepseek-v3-sigmoid-bias"][1]["rope_parameters"], mscale=0.8, mscale_all_dim=0.8)
# gguf architecture, a test_families_moe family (DeepSeek-V3's yarn with mscale = mscale_all_dim: all GGUF keeps)
CASES = {
    # llama.cpp's qwen2moe has no dense-layer tensors: every layer sparse
    "qwen2moe-shared": ("qwen2moe", ("Qwen2MoeConfig", dict(FAMILIES["qwen2moe-shared-mlponly"][1],
                                                            mlp_only_layers=[]))),
    "qwen3moe-top8-qknorm": ("qwen3moe", FAMILIES["qwen3moe-top8-qknorm"]),
    "deepseek-v2-qlora-grouped": ("deepseek2", FAMILIES["deepseek-v2-qlora-grouped"]),
    "deepseek-v3-sigmoid-bias-yarn": ("deepseek2", ("DeepseekV3Config", dict(
        FAMILIES["deepseek-v3-sigmoid-bias"][1], rope_parameters=_YARN_EQUAL))),
}


def hf_to_gguf(folder, arch: str, out) -> None:
    """convert_hf_to_gguf.py's output for these architectures (its Qwen2MoeModel / Qwen3MoeModel /
    DeepseekV2Model), F32 tensors."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    L, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "deepseek2":
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        v3 = cfg["model_type"] == "deepseek_v3"
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
        if v3 or cfg.get("topk_method") == "group_limited_greedy":
            w.add_expert_group_count(cfg["n_group"])
            w.add_expert_group_used_count(cfg["topk_group"])
        if cfg["q_lora_rank"]:
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(cfg["kv_lora_rank"])
        rot, nope, v = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        w.add_key_length(cfg["kv_lora_rank"] + rot)  # the latent's (llama.cpp's MLA layout) ...
        w.add_value_length(cfg["kv_lora_rank"])
        w.add_key_length_mla(nope + rot)  # ... and the expanded heads'
        w.add_value_length_mla(v)
        w.add_rope_dimension_count(rot)
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    else:
        w.add_expert_count(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
        head_dim = cfg.get("head_dim") or hidden // heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    tensors = load_file(folder / "model.safetensors")
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), L)
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, data in tensors.items():
        parts = name.split(".")
        if ".mlp.experts." in name:  # model.layers.i.mlp.experts.e.gate_proj.weight -> stacked per layer
            stacked.setdefault(".".join(parts[:5] + parts[6:7]), {})[int(parts[5])] = data
            continue
        if name.endswith("kv_b_proj.weight") and arch == "deepseek2":  # llama.cpp's k_b / v_b split
            kv_b = data.reshape(heads, nope + v, cfg["kv_lora_rank"])
            k_b, v_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(kv_b[:, nope:])
            w.add_tensor(names.get_name(name.replace("kv_b_proj.weight", "k_b_proj")) + ".weight", k_b)
            w.add_tensor(names.get_name(name.replace("kv_b_proj.weight", "v_b_proj")) + ".weight", v_b)
            continue
        base, suffix = name.replace("e_score_correction_bias", "e_score_correction.bias").rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", data.astype(np.float32))
    for base, experts in stacked.items():
        w.add_tensor(names.get_name(base) + ".weight", np.stack([experts[e] for e in sorted(experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_of_the_family_matches_hf(tmp_path, default_model_dir, case):
    seed = int.from_bytes(os.urandom(4), "little")
    arch, (cls_name, overrides) = CASES[case]
    build(tmp_path, cls_name, overrides, seed, default_model_dir)
    hf_to_gguf(tmp_path, arch, tmp_path / "tiny.gguf")
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in (9, 40, 90)]
    expected = hf_greedy(tmp_path, prompts, 12)
    llm = LLM(str(tmp_path / "tiny.gguf"), tokenizer=str(default_model_dir), dtype="float32", device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected, f"model seed {seed}"
