"""Prompt logprobs: SamplingParams(prompt_logprobs=N) offline and echo + logprobs on /v1/completions equal HF's
log-softmax of the prompt (float32, a tiny random model), under chunked prefill and with the prefix cache on."""

import json

import httpx
import pytest
import torch

from vserve import LLM, SamplingParams

PROMPTS = [list(range(5, 45)), list(range(300, 370)), [7], [11, 12]]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf_logprobs(tiny_dir):
    """prompt -> [len, vocab] log-softmax of HF's logits (row i scores token i + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return run


def check_against_hf(prompt: list[int], plp: list, ref: torch.Tensor, n_top: int) -> None:
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        entry, row, tok = plp[i], ref[i - 1], prompt[i]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4, f"position {i}"
        # the rank of a float32 value among ~49k: equal up to values within the tolerance
        assert int((row > row[tok] + 1e-4).sum()) + 1 <= entry[tok].rank <= int((row > row[tok] - 1e-4).sum()) + 1
        top = row.topk(n_top)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= n_top)
        assert [t for _, t, _ in ranked] == top.indices.tolist(), f"position {i}: top-{n_top} ids"
        assert max([abs(a - b) for (_, _, a), b in zip(ranked, top.values.tolist())], default=0.0) < 1e-4
        assert set(entry) == set(top.indices.tolist()) | {tok}


@pytest.mark.parametrize("budget", [8192, 16], ids=["one-pass", "chunked-16"])
def test_prompt_logprobs_equal_hf_log_softmax(tiny_dir, hf_logprobs, budget):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=512, max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    for p, out in zip(PROMPTS, outs):
        check_against_hf(p, out.prompt_logprobs, hf_logprobs(p), 3)
        assert len(out.outputs[0].token_ids) == 2
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prefix_cache_hit_keeps_prompt_logprobs(tiny_dir, hf_logprobs):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=512, enable_prefix_caching=True)
    prompt = PROMPTS[1]
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
    again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64  # the cache holds the prompt's blocks
    scored = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0  # read no cached block: every position was run and scored
    check_against_hf(prompt, scored.prompt_logprobs, hf_logprobs(prompt), 0)
    assert all(len(e) == 1 for e in scored.prompt_logprobs[1:])  # prompt_logprobs=0: the prompt's token only


def test_prompt_logprobs_survive_preemption(tiny_dir, hf_logprobs):
    """Too few KV blocks for both prompts: one is preempted and recomputed; its prompt is scored once."""
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=9,
              max_num_batched_tokens=32, enable_prefix_caching=False)
    prompts = [list(range(40, 100)), list(range(600, 660))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, ignore_eos=True))
    assert llm.llm_engine.stats().num_preemptions > 0
    for p, out in zip(prompts, outs):
        check_against_hf(p, out.prompt_logprobs, hf_logprobs(p), 1)


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_bad_prompt_logprobs_is_a_value_error(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=bad)


# ---- the server: echo + logprobs, the legacy completions format ---------------------------------------------


@pytest.fixture(scope="module")
def server(server_factory, tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    return server_factory([str(tiny_dir), "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
                           "--max-model-len", "512", "--max-num-batched-tokens", "16"], log)


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_logprobs_score_the_prompt(server, hf_logprobs, tiny_dir, max_tokens):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompt = PROMPTS[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 2,
            "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_logprobs(prompt)
    for i in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, prompt[i]].item()) < 1e-4
        top = ref[i - 1].topk(2)
        assert lp["top_logprobs"][i] == pytest.approx(
            {tok.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}, abs=1e-4)
    assert lp["tokens"][:len(prompt)] == [tok.decode([t]) for t in prompt]
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(offsets[i + 1] == offsets[i] + len(lp["tokens"][i]) for i in range(len(offsets) - 1))
    assert choice["text"].startswith(tok.decode(prompt))
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_max_tokens_zero_needs_echo(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0, "logprobs": 1})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_streamed_echo_carries_the_prompt_logprobs_first(server, hf_logprobs):
    prompt = PROMPTS[1]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["token_logprobs"]) == len(prompt)
    ref = hf_logprobs(prompt)
    assert first["token_logprobs"][1:] == pytest.approx([ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))],
                                                        abs=1e-4)
    generated = [t for e in events[1:] for t in (e["choices"][0]["logprobs"] or {"tokens": []})["tokens"]]
    assert len(generated) == 3


def test_vllm_prompt_logprobs_field(server, hf_logprobs):
    prompt = PROMPTS[0]
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                         "prompt_logprobs": 2, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    ref = hf_logprobs(prompt)
    for i in range(1, len(prompt)):
        top = ref[i - 1].topk(2).indices.tolist()
        assert set(plp[i]) == {str(t) for t in [*top, prompt[i]]}
        assert plp[i][str(prompt[i])]["logprob"] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
    assert r.json()["choices"][0]["logprobs"] is None  # no echo: the legacy logprobs are not asked for


def test_prompt_logprobs_under_tensor_parallel(tiny_dir, hf_logprobs):
    """Every rank runs the scoring rows (the LM head's all-gather is a collective); rank 0 keeps the result."""
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=512, tensor_parallel_size=2,
              max_num_batched_tokens=32)
    try:
        outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    finally:
        llm.llm_engine.shutdown()
    for p, out in zip(PROMPTS[:2], outs):
        check_against_hf(p, out.prompt_logprobs, hf_logprobs(p), 1)
