"""Async scheduling (step N+1 scheduled and launched before step N's tokens are processed) changes nothing a
user sees: same tokens, texts and finish reasons as the synchronous engine, no leaked KV blocks. It is on by
default on one CUDA GPU only; here it is forced on over the CPU path, which runs the same host logic."""

import random

import pytest

from vserve import LLM, SamplingParams


def _prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _outputs(llm, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _pair(folder, **kw):
    sync = LLM(folder, dtype="float32", device="cpu", async_scheduling=False, **kw)
    overlap = LLM(folder, dtype="float32", device="cpu", async_scheduling=True, **kw)
    assert overlap.llm_engine.info.async_scheduling and not sync.llm_engine.info.async_scheduling
    return sync, overlap


def _assert_clean(llm):
    stats = llm.llm_engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("kw", [{}, dict(num_kv_blocks=14, max_model_len=200, max_num_batched_tokens=48)],
                         ids=["roomy", "preemption+chunked-prefill"])
def test_async_matches_sync_greedy_sampled_and_stops(tiny_model, kw):
    folder = str(tiny_model("llama"))
    sync, overlap = _pair(folder, block_size=16, **kw)
    prompts = _prompts(8, 20, 90, 3)
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 30, 1, 17, 30, 8, 22, 30)]
    base = _outputs(sync, prompts, greedy)
    # stop on tokens/strings that greedy decoding actually reaches mid-output, so requests end early
    stops = []
    for i, (ids, text, _, _) in enumerate(base):
        if i % 2 and len(ids) > 4:
            stops.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[3]]))
        elif len(text) > 6:
            stops.append(SamplingParams(temperature=0, max_tokens=30, stop=[text[4:6]], ignore_eos=True))
        else:
            stops.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    sampled = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=i, ignore_eos=True)
               for i in range(8)]
    runner, kinds = overlap.llm_engine.core.runner, []
    build = runner.build_step

    def spy(*a):  # which way each step's in-flight input tokens reach the device
        step, reqs = build(*a)
        kinds.append("all" if step.pending_all else "rows" if step.pending_rows is not None else "host")
        return step, reqs

    runner.build_step = spy
    for params in (greedy, stops, sampled):
        assert _outputs(overlap, prompts, params) == _outputs(sync, prompts, params)
    # a steady decode batch takes the last step's tokens as they are; one whose requests changed gathers them
    assert {"all", "rows"} <= set(kinds), kinds
    assert any(o[2] == "stop" for o in _outputs(overlap, prompts, stops))
    if kw:
        assert overlap.llm_engine.stats().num_preemptions > 0
    _assert_clean(overlap)


def test_penalties_and_logprobs_keep_async_steps_with_sync_results(tiny_model):
    """Requests whose sampling reads their own latest token (penalties, min_tokens) or that want logprobs keep
    async scheduling on (the sampler's token counts hold the token in flight): same results as sync."""
    folder = str(tiny_model("llama"))
    sync, overlap = _pair(folder)
    prompts = _prompts(4, 10, 40, 4)
    params = [SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=8, logprobs=2),
              SamplingParams(temperature=0, max_tokens=16, frequency_penalty=1.0, presence_penalty=0.5,
                             ignore_eos=True)]
    engine = overlap.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    overlapped = 0
    while engine.has_unfinished_requests():
        engine.step()
        overlapped += engine.core.in_flight is not None  # a step is on the device while this one returned
    assert overlapped >= 16
    while engine.core.in_flight is not None and engine.step():
        pass
    got = overlap.generate(prompts, params, use_tqdm=False)
    want = sync.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lg, lw = g.outputs[0].logprobs, w.outputs[0].logprobs
        assert (lg is None) == (lw is None)
        if lg is not None:
            assert [sorted(d) for d in lg] == [sorted(d) for d in lw]
    _assert_clean(overlap)


def test_abort_while_a_step_is_in_flight(tiny_model):
    folder = str(tiny_model("llama"))
    sync, overlap = _pair(folder)
    prompts = _prompts(4, 10, 40, 5)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = {str(i): o[0] for i, o in enumerate(_outputs(sync, prompts, sp))}
    engine = overlap.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):
            done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 5:
            assert engine.core.in_flight is not None  # a step is on the device while this one returned
            engine.abort_request("1")
    while engine.core.in_flight is not None and engine.step():  # drain the last launch
        pass
    assert "1" not in done
    assert done == {k: v for k, v in want.items() if k != "1"}
    _assert_clean(overlap)


def test_async_scheduling_is_refused_under_tensor_parallelism(tiny_model):
    with pytest.raises(ValueError, match="async-scheduling"):
        LLM(str(tiny_model("llama")), dtype="float32", device="cpu", async_scheduling=True, tensor_parallel_size=2)
