"""Greedy output of the MoE and MLA families is token-identical to HF transformers (float32, tiny random models drawn
from fresh seeds, norm weights randomized), in one batch of 6 prompts x 40 new tokens, under the engine settings of
tests/test_families.py (block sizes, prefix caching, chunked prefill with preemption); and TP=2 on gloo gives the
same tokens for one MoE family and the MLA family."""

import pytest
from test_families import (
    ENGINE_SETTINGS,
    build_tiny,
    check_greedy,
    check_tensor_parallel_2,
    reference_getter,
)

from vserve import LLM

_MOE = dict(moe_intermediate_size=32, num_hidden_layers=3)
# MLA: latent 32, RoPE 8 + no-RoPE 16 dims per head, values 24; KV heads = heads (HF expands the latent per head);
# yarn past 64 positions (the prompts run to 130)
_MLA = dict(_MOE, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
            n_routed_experts=8, first_k_dense_replace=1)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
             beta_slow=1)
# name -> (transformers config class, overrides): each family's structural switches
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)),
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse with the gated shared expert; weights not renormalized
    "qwen2moe-shared-mlponly": ("Qwen2MoeConfig", dict(_MOE, num_experts=8, num_experts_per_tok=2,
                                                       shared_expert_intermediate_size=48, decoder_sparse_step=1,
                                                       mlp_only_layers=[1], norm_topk_prob=False)),
    # every second layer sparse (decoder_sparse_step 2), renormalized top-k
    "qwen2moe-step2-norm": ("Qwen2MoeConfig", dict(_MOE, num_experts=6, num_experts_per_tok=3,
                                                   shared_expert_intermediate_size=40, decoder_sparse_step=2,
                                                   norm_topk_prob=True)),
    "qwen3moe-top8-qknorm": ("Qwen3MoeConfig", dict(_MOE, num_experts=16, num_experts_per_tok=8, head_dim=32,
                                                    norm_topk_prob=True)),
    # no q LoRA, greedy softmax top-2 over 8 experts + 2 shared, yarn whose mscales cancel in the RoPE table
    "deepseek-v2-qnone-yarn": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None, num_experts_per_tok=2,
                                                        n_shared_experts=2, topk_method="greedy",
                                                        rope_parameters=dict(_YARN, mscale=0.707,
                                                                             mscale_all_dim=0.707))),
    # q LoRA, group_limited_greedy (4 groups, best 2 eligible), routed_scaling_factor
    "deepseek-v2-qlora-grouped": ("DeepseekV2Config", dict(_MLA, q_lora_rank=24, num_experts_per_tok=3,
                                                           n_shared_experts=1, topk_method="group_limited_greedy",
                                                           n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    # sigmoid scores + e_score_correction_bias (randomized), top-2-sum groups, renormalized, scaled by 2.5; yarn
    # with mscale != mscale_all_dim (RoPE table and softmax scale both scaled)
    "deepseek-v3-sigmoid-bias": ("DeepseekV3Config", dict(_MLA, q_lora_rank=24, num_experts_per_tok=3,
                                                          n_shared_experts=1, n_group=4, topk_group=2,
                                                          norm_topk_prob=True, routed_scaling_factor=2.5,
                                                          rope_parameters=dict(_YARN, mscale=1.0,
                                                                               mscale_all_dim=0.8))),
}


def build(folder, cls_name, overrides, seed, tokenizer_dir):
    """build_tiny, then V3's e_score_correction_bias (zeros from HF's init: they would hide a wrong use) drawn."""
    import torch
    from safetensors.torch import load_file, save_file

    build_tiny(folder, cls_name, overrides, seed, tokenizer_dir)
    if cls_name == "DeepseekV3Config":
        tensors = load_file(folder / "model.safetensors")
        g = torch.Generator().manual_seed(seed)
        for name in tensors:
            if name.endswith("e_score_correction_bias"):
                tensors[name] = torch.rand(tensors[name].shape, generator=g) * 0.5
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def references(tmp_path_factory, default_model_dir):
    return reference_getter(tmp_path_factory, default_model_dir, FAMILIES, build)


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf(references, family, setting):
    check_greedy(*references(family), setting)


TP_CASES = {name: FAMILIES[name] for name in ("qwen2moe-shared-mlponly", "deepseek-v3-sigmoid-bias")}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_2_matches_hf(tmp_path, default_model_dir, case):
    check_tensor_parallel_2(tmp_path, default_model_dir, *TP_CASES[case], build=build)


MOE_SHAPES = ["mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "deepseek-v2-lite", "deepseek-v3"]


@pytest.mark.parametrize("name", MOE_SHAPES)
def test_planned_parameters_are_the_built_models(name):
    """A few layers of the published shape (DeepSeek-V3: 4, past its 3 dense ones), built on the meta device: the
    planner counts MLA's projections and norms, dense layers, shared experts, routers and V3's correction bias."""
    import torch

    from vserve.core.memory import num_params
    from vserve.core.model_config import ModelConfig
    from vserve.core.models import get_model_class
    from vserve.ops.model_shapes import KNOWN_SHAPES

    m = ModelConfig.from_dict({**KNOWN_SHAPES[name], "num_hidden_layers": 4 if name == "deepseek-v3" else 2,
                               "vocab_size": 1000})
    with torch.device("meta"):
        model = get_model_class(m)(m)
    assert sum(p.numel() for p in model.parameters()) == num_params(m)


@pytest.mark.parametrize("name,billions", [("mixtral-8x7b", 46.7), ("qwen1.5-moe-a2.7b", 14.3),
                                           ("qwen3-30b-a3b", 30.5), ("deepseek-v2-lite", 15.7), ("deepseek-v3", 671)])
def test_published_sizes(name, billions):
    from vserve.core.memory import num_params
    from vserve.ops.model_shapes import known_shape

    assert num_params(known_shape(name)) / 1e9 == pytest.approx(billions, rel=0.01)


def test_doctor_plans_the_latent_kv_cache_of_a_deepseek_v2_lite_folder(tmp_path, monkeypatch):
    """`vserve doctor FOLDER --json` on DeepSeek-V2-Lite's config.json: KV bytes per token = layers x (kv_lora_rank
    + rope dim) x 2 bytes (27 x 576 x 2 = 31,104), not 2 x layers x heads x head dim; the blocks follow from it."""
    import json

    from test_doctor import HEALTHY, runner

    from vserve.cli.main import app
    from vserve.ops import probe
    from vserve.ops.model_shapes import KNOWN_SHAPES

    cfg = KNOWN_SHAPES["deepseek-v2-lite"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(probe, "probe_environment", lambda: HEALTHY)
    res = runner.invoke(app, ["doctor", str(tmp_path), "--max-model-len", "32768", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    per_token = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    assert per_token == 31104 and plan["kv_bytes_per_token"] == per_token
    assert plan["kv_bytes_per_block"] == per_token * plan["block_size"]
    assert plan["kv_cache_bytes"] == plan["num_blocks"] * plan["kv_bytes_per_block"]
    res = runner.invoke(app, ["doctor", str(tmp_path), "--max-model-len", "32768"], env={"COLUMNS": "200"})
    assert "30.375 KiB/token" in res.stdout  # the memory-plan check line


def test_the_kv_cache_holds_the_latent_only(references):
    """Each MLA layer's cache is [blocks, block size, 1, kv_lora_rank + rope dim], no value cache; the engine's cache
    bytes per token are the planner's."""
    import json

    from vserve.core.memory import kv_bytes_per_token
    from vserve.core.model_config import ModelConfig

    folder = references("deepseek-v2-qlora-grouped")[0]
    raw = json.loads((folder / "config.json").read_text())
    llm = LLM(str(folder), dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=16, num_kv_blocks=8,
              max_model_len=128)
    runner = llm.llm_engine.core.runner
    layers = runner.model.attention_layers()
    assert len(layers) == raw["num_hidden_layers"]
    for attn in layers:
        assert tuple(attn.k_cache.shape) == (8, 16, 1, raw["kv_lora_rank"] + raw["qk_rope_head_dim"])
        assert attn.v_cache.numel() == 0
    per_token = sum(a.k_cache[0, 0].numel() * a.k_cache.element_size() for a in layers)
    assert per_token == kv_bytes_per_token(ModelConfig.from_dict(raw), 4)
