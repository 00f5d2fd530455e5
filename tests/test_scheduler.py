"""Scheduler: one token budget, decodes and prefill chunks mixed, preemption by recompute loses nothing."""

import random

from vserve import LLM, SamplingParams


def _prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_steps_respect_token_budget_and_max_num_seqs(tiny_model):
    llm = LLM(str(tiny_model("llama")), dtype="float32", device="cpu", max_num_batched_tokens=48, max_num_seqs=3)
    engine = llm.llm_engine
    for i, p in enumerate(_prompts(6, 20, 100, 1)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    steps = []
    orig = engine.core.runner.launch

    def spy(sched, block_ids, *rest):
        steps.append((sched.total_tokens, list(sched.num_scheduled_tokens)))
        assert sched.num_prompt_tokens == _prompt_tokens(sched)
        return orig(sched, block_ids, *rest)

    engine.core.runner.launch = spy
    while engine.has_unfinished_requests():
        engine.step()
    mixed = False
    for total, sizes in steps:
        assert total <= 48
        assert len(sizes) <= 3
        # decodes (single tokens) come first, prefill chunks after
        assert sizes == sorted(sizes, key=lambda n: n != 1)
        mixed |= 1 in sizes and any(n > 1 for n in sizes)
    assert mixed, "a step should mix decodes with a prefill chunk"


def _prompt_tokens(sched):
    """The prompt tokens a step computes, counted row by row (what the scheduler's running total must equal)."""
    return sum(max(0, min(n, r.num_prompt_tokens - r.num_computed_tokens))
               for r, n in zip(sched.requests, sched.num_scheduled_tokens))


def test_preempted_request_finishes_with_same_tokens(tiny_model):
    folder = str(tiny_model("llama"))
    prompts = _prompts(8, 40, 120, 2)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(folder, dtype="float32", device="cpu", block_size=16)
    tight = LLM(folder, dtype="float32", device="cpu", block_size=16, num_kv_blocks=14, max_model_len=200)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, sp)]
    orig, counts = tight.llm_engine.core.runner.launch, []

    def spy(sched, block_ids, *rest):  # recomputed prompts after a preemption count again, cache hits never
        counts.append((sched.num_prompt_tokens, _prompt_tokens(sched)))
        return orig(sched, block_ids, *rest)

    tight.llm_engine.core.runner.launch = spy
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, sp)]
    assert all(a == b for a, b in counts) and sum(a for a, _ in counts) > sum(map(len, prompts))
    stats = tight.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert got == expected
    assert stats.num_free_blocks == stats.num_blocks


def test_seeded_sampling_survives_preemption(tiny_model):
    folder = str(tiny_model("llama"))
    prompts = _prompts(6, 40, 120, 3)
    sps = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=30, ignore_eos=True)
           for i in range(len(prompts))]
    roomy = LLM(folder, dtype="float32", device="cpu")
    tight = LLM(folder, dtype="float32", device="cpu", num_kv_blocks=12, max_model_len=160)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, sps)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, sps)]
    assert tight.llm_engine.stats().num_preemptions > 0
    assert got == expected
