"""Greedy output is token-identical to HF transformers `generate` on the same weights (float32)."""

import random

import pytest
from conftest import assert_same_tokens

from vserve import LLM, SamplingParams

NEW_TOKENS = 48
PROMPT_LENS = (5, 17, 33, 64, 90, 130)

FAMILIES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied-llama3": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                            rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64})),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32)),
}

# (block_size, prefix caching, extra engine args)
ENGINE_SETTINGS = {
    "bs16-cache": (16, True, {}),
    "bs64-nocache": (64, False, {}),
    # 40-token budget chunks every long prompt; 24 blocks of 16 cannot hold all six sequences at once.
    "bs16-chunked-preempt": (16, True, dict(max_num_batched_tokens=40, num_kv_blocks=24, max_model_len=256)),
}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(tiny_model, hf_greedy):
    cache = {}

    def get(family):
        if family not in cache:
            arch, overrides = FAMILIES[family]
            folder = tiny_model(arch, **overrides)
            prompts = _prompts(hash(family) % 1000)
            cache[family] = (folder, prompts, hf_greedy(folder, prompts, NEW_TOKENS))
        return cache[family]

    return get


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf(references, family, setting):
    folder, prompts, expected = references(family)
    block_size, caching, extra = ENGINE_SETTINGS[setting]
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=block_size,
              enable_prefix_caching=caching, **extra)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert_same_tokens([o.outputs[0].token_ids for o in outs], expected, prompts)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    if setting == "bs16-chunked-preempt":
        assert stats.num_preemptions > 0, "the setting was meant to force preemption"


@pytest.mark.parametrize("family", ["llama-gqa-untied", "qwen3-qknorm"])
def test_greedy_matches_hf_through_the_engine_process(references, family):
    """The same parity with the core in a spawned engine process (the GPU and `vserve serve` default), async
    scheduling on, and preemption forced: the tokens cross the pipe as core outputs and the front end
    detokenizes them."""
    folder, prompts, expected = references(family)
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=16, engine_process=True, async_scheduling=True,
              max_num_batched_tokens=40, num_kv_blocks=24, max_model_len=256)
    try:
        assert llm.llm_engine.core is None  # not in this process
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats = llm.llm_engine.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()


def test_smollm2_matches_hf(default_model_dir, hf_greedy):
    prompts_text = ["The capital of France is", "def fibonacci(n):",
                    "Once upon a time, in a small village,", "The three primary colors are"]
    llm = LLM(dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    prompts = [tok(p).input_ids for p in prompts_text]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    expected = hf_greedy(default_model_dir, prompts, new_tokens=24)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_default_model_knows_paris():
    out = LLM().generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")
