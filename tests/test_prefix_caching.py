"""Prefix caching: a request sharing a cached prefix computes only its new tokens, with unchanged output."""

import random

from vserve import LLM, SamplingParams

BLOCK = 16


def _run_two(llm, shared, tail_a, tail_b):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([shared + tail_a], sp)[0]
    engine = llm.llm_engine
    runner = engine.core.runner
    computed = []
    orig = runner.launch

    def spy(sched, block_ids, *rest):
        computed.append(sched.total_tokens)
        return orig(sched, block_ids, *rest)

    runner.launch = spy
    try:
        second = llm.generate([shared + tail_b], sp)[0]
    finally:
        runner.launch = orig
    return first, second, computed


def test_second_request_computes_only_new_tokens_and_matches_uncached(tiny_model):
    folder = tiny_model("llama")
    rng = random.Random(7)
    shared = [rng.randrange(3, 49152) for _ in range(3 * BLOCK)]
    tail_a = [rng.randrange(3, 49152) for _ in range(5)]
    tail_b = [rng.randrange(3, 49152) for _ in range(9)]

    cached = LLM(str(folder), dtype="float32", device="cpu", block_size=BLOCK, enable_prefix_caching=True)
    hits_before = cached.llm_engine.stats().prefix_cache_hits
    first, second, computed = _run_two(cached, shared, tail_a, tail_b)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 3 * BLOCK
    assert cached.llm_engine.stats().prefix_cache_hits - hits_before == 3 * BLOCK
    # prefill step computes only the 9 new prompt tokens; then one token per decode step
    assert computed[0] == len(tail_b)
    assert all(n == 1 for n in computed[1:])

    plain = LLM(str(folder), dtype="float32", device="cpu", block_size=BLOCK, enable_prefix_caching=False)
    p_first, p_second, p_computed = _run_two(plain, shared, tail_a, tail_b)
    assert p_second.num_cached_tokens == 0
    assert p_computed[0] == 3 * BLOCK + len(tail_b)
    assert second.outputs[0].token_ids == p_second.outputs[0].token_ids
    assert first.outputs[0].token_ids == p_first.outputs[0].token_ids


def test_fully_cached_prompt_recomputes_its_last_block(tiny_model):
    """A prompt of exactly 3 full blocks seen before hits 2 blocks: the last token's logits are needed."""
    folder = tiny_model("llama")
    rng = random.Random(8)
    prompt = [rng.randrange(3, 49152) for _ in range(3 * BLOCK)]
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=BLOCK)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = llm.generate([prompt], sp)[0]
    b = llm.generate([prompt], sp)[0]
    assert b.num_cached_tokens == 2 * BLOCK
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_cache_salt_keeps_tenants_apart_and_outputs_unchanged(tiny_model):
    """vLLM's prompt dicts with a cache_salt: the same prompt under another salt (or none) computes again."""
    import pytest

    llm = LLM(str(tiny_model("llama")), dtype="float32", device="cpu", block_size=BLOCK)
    rng = random.Random(9)
    prompt = [rng.randrange(3, 49152) for _ in range(3 * BLOCK + 4)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, sp)[0]
    other = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, sp)[0]
    unsalted = llm.generate(prompt, sp)[0]
    same = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], sp)[0]
    assert [o.num_cached_tokens for o in (first, other, unsalted, same)] == [0, 0, 0, 3 * BLOCK]
    assert len({tuple(o.outputs[0].token_ids) for o in (first, other, unsalted, same)}) == 1
    text = llm.generate({"prompt": "The capital of France is", "cache_salt": "t"}, sp)[0]
    assert text.prompt == "The capital of France is"
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": "x", "cache_salt": ""}, sp)
    with pytest.raises(ValueError, match='a prompt dict holds "prompt" or "prompt_token_ids"'):
        llm.generate({"prompt": "x", "salt": "a"}, sp)
