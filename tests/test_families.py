"""Greedy output of every dense family beyond Llama is token-identical to HF transformers (float32, tiny random
models drawn from fresh seeds), in one batch of 6 prompts x 40 new tokens, under the engine settings
test_hf_parity uses (block sizes, prefix caching, chunked prefill with preemption); prompts and outputs run past
the sliding window where the family has one (window 24, prompts up to 90 tokens)."""

import os
import random
import shutil

import pytest
from conftest import assert_same_tokens

from vserve import LLM, SamplingParams

NEW_TOKENS = 40
PROMPT_LENS = (5, 17, 30, 48, 71, 90)
WINDOW = 24
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)

# name -> (transformers config class, overrides): each family's structural switches, tied and untied heads mixed
FAMILIES = {
    "gemma-tied": ("GemmaConfig", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma2-softcap-window-untied": ("Gemma2Config", dict(head_dim=32, sliding_window=WINDOW, tie_word_embeddings=False,
                                                          query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                                          final_logit_softcapping=3.0)),
    "gemma3-local-global-tied": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=WINDOW, sliding_window_pattern=2,
                                                          tie_word_embeddings=True, rope_local_base_freq=100.0,
                                                          rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "phi3-longrope-partial-window": ("Phi3Config", dict(
        sliding_window=WINDOW, partial_rotary_factor=0.5, original_max_position_embeddings=256,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(4)],
                      "long_factor": [2.0 + i for i in range(4)]})),
    "cohere-qknorm-tied": ("CohereConfig", dict(use_qk_norm=True, logit_scale=0.5, tie_word_embeddings=True)),
    "cohere2-window-nope-untied": ("Cohere2Config", dict(sliding_window=WINDOW, sliding_window_pattern=2,
                                                         tie_word_embeddings=False, logit_scale=0.5)),
    "starcoder2-bias-window-tied": ("Starcoder2Config", dict(sliding_window=WINDOW, tie_word_embeddings=True)),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW)),
}

# (block_size, prefix caching, extra engine args), as tests/test_hf_parity.py
ENGINE_SETTINGS = {
    "bs16-cache": (16, True, {}),
    "bs64-nocache": (64, False, {}),
    # a 40-token budget chunks every long prompt; 24 blocks of 16 cannot hold all six sequences at once
    "bs16-chunked-preempt": (16, True, dict(max_num_batched_tokens=40, num_kv_blocks=24, max_model_len=256)),
}


def build_tiny(folder, cls_name: str, overrides: dict, seed: int, tokenizer_dir) -> None:
    """A random HF model of the family (float32) saved with SmolLM2's tokenizer."""
    import torch
    import transformers

    cfg = getattr(transformers, cls_name)(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # zero-initialized norm weights (Gemma's 1 + w) would hide a wrong norm: draw them too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if cls_name.startswith("Gemma") else 1.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)


def hf_greedy(folder, prompts, new_tokens: int) -> list[list[int]]:
    """HF `generate` with eager attention (Gemma 2's softcap exists only there), one prompt at a time."""
    from conftest import _hf_greedy

    return _hf_greedy(folder, prompts, new_tokens, attn_implementation="eager")


def reference_getter(tmp_path_factory, default_model_dir, families: dict, build=build_tiny):
    """get(family) -> (folder, prompts, HF's greedy tokens, seed): the family's tiny model (built once, from a fresh
    seed) and its 6 prompts."""
    cache = {}

    def get(family):
        if family not in cache:
            seed = int.from_bytes(os.urandom(4), "little")
            cls_name, overrides = families[family]
            folder = tmp_path_factory.mktemp(family)
            build(folder, cls_name, overrides, seed, default_model_dir)
            rng = random.Random(seed)
            prompts = [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]
            cache[family] = (folder, prompts, hf_greedy(folder, prompts, NEW_TOKENS), seed)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def references(tmp_path_factory, default_model_dir):
    return reference_getter(tmp_path_factory, default_model_dir, FAMILIES)


def check_greedy(folder, prompts, expected, seed, setting: str, **overrides) -> None:
    """The 6 prompts through vserve under ENGINE_SETTINGS[setting] (+ overrides) give HF's tokens, every block is
    free afterwards, and the preemption setting preempted."""
    block_size, caching, extra = ENGINE_SETTINGS[setting]
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=block_size, enable_prefix_caching=caching,
              **{**extra, **overrides})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert_same_tokens([o.outputs[0].token_ids for o in outs], expected, prompts, f"(model seed {seed})")
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    if setting == "bs16-chunked-preempt":
        assert stats.num_preemptions > 0, "the setting was meant to force preemption"


def _every_layer_slides(folder) -> bool:
    import json

    from vserve.core.model_config import ModelConfig

    return ModelConfig.from_dict(json.loads((folder / "config.json").read_text())).kv_window() is not None


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf(references, family, setting):
    folder, prompts, expected, seed = references(family)
    # blocks behind the window go back to the pool: 24 would hold all six; 8 hold one (6 blocks) but not two
    window = dict(num_kv_blocks=8) if setting == "bs16-chunked-preempt" and _every_layer_slides(folder) else {}
    check_greedy(folder, prompts, expected, seed, setting, **window)


TP_CASES = {  # what sharding adds: fused checkpoint tensors split per rank, per-head norms, a replicated KV head
    "phi3-fused-qkv": ("Phi3Config", dict(sliding_window=WINDOW)),
    "cohere-qknorm-mqa": ("CohereConfig", dict(use_qk_norm=True, num_key_value_heads=1)),
    "gemma2-softcap": ("Gemma2Config", dict(head_dim=32, sliding_window=WINDOW, attn_logit_softcapping=5.0)),
}


def check_tensor_parallel_2(tmp_path, default_model_dir, cls_name: str, overrides: dict, build=build_tiny) -> None:
    """A fresh tiny model of the family under TP=2 (gloo) gives HF's greedy tokens (2 prompts, chunked prefill)."""
    seed = int.from_bytes(os.urandom(4), "little")
    build(tmp_path, cls_name, overrides, seed, default_model_dir)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in (7, 40)]
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2,
              max_num_batched_tokens=32)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tmp_path, prompts, 16), f"model seed {seed}"


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_2_matches_hf(tmp_path, default_model_dir, case):
    check_tensor_parallel_2(tmp_path, default_model_dir, *TP_CASES[case])


def test_longrope_prompts_longer_than_the_original_length_match_hf(default_model_dir, tmp_path):
    """Phi-3's LongRoPE past original_max_position_embeddings (48 here): HF runs a prompt longer than that with the
    long factors at every position, a shorter one with the short factors; vserve gives such prompts' tokens the long
    factors below 48 too (ModelRunner's row offset), under chunked prefill, and never shares prefix-cache blocks
    between the two kinds (a long prompt sharing its first 40 tokens with a short one, run before it and after)."""
    seed = int.from_bytes(os.urandom(4), "little")
    build_tiny(tmp_path, "Phi3Config", dict(
        original_max_position_embeddings=48,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(8)],
                      "long_factor": [3.0 + 2 * i for i in range(8)]}), seed, default_model_dir)
    rng = random.Random(seed)
    shared = [rng.randrange(3, TINY["vocab_size"]) for _ in range(40)]
    short, long = shared + [rng.randrange(3, 49152) for _ in range(1)], shared + [rng.randrange(3, 49152)
                                                                               for _ in range(50)]
    others = [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in (5, 20, 60, 90)]
    new = 7  # the short prompts stay within 48 tokens (crossing it while decoding: docs/models.md)
    expected = hf_greedy(tmp_path, [long, short, *others], new)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=16, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate([long], params)]
    rest = [o.outputs[0].token_ids for o in llm.generate([short, *others, long], params)]
    assert first + rest[:-1] == expected and rest[-1] == expected[0], f"model seed {seed}"
    assert rest[-1] and llm.llm_engine.core.kv.prefix_cache_hits > 0  # the long prompt's second run hit its blocks
