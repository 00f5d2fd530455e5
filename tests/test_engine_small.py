"""End to end on a tiny random Llama (2 layers, hidden 64) with the default model's tokenizer, on CPU."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vserve.core.llm import LLM
from vserve.core.sampling_params import SamplingParams

VOCAB = 49152
MAX_MODEL_LEN = 512  # the tiny config's max_position_embeddings
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Iterator[tuple[Path, torch.nn.Module]]:
    """A random LlamaForCausalLM saved as safetensors, with SmolLM2's tokenizer files beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vserve.ops.assets import default_model_path

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for f in default_model_path().iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    # Matrices this small run many times faster on one thread than on several contending ones.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield folder, model
    torch.set_num_threads(threads)


@pytest.fixture
def llm(tiny_llama) -> LLM:
    return LLM(model=str(tiny_llama[0]), dtype="float32", device="cpu", num_kv_blocks=128, seed=0)


def random_prompt(gen: torch.Generator, length: int) -> list[int]:
    return torch.randint(20, VOCAB, (length,), generator=gen).tolist()


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert (engine.core.requests, engine.output.parents, engine.output.states) == ({}, {}, {})
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_blocks


# ---- stopping -----------------------------------------------------------------------------------------------


def test_min_tokens_defers_eos_until_that_many_tokens_are_out(llm):
    eos = llm.get_tokenizer().eos_token_id
    wants_eos = {eos: 100.0}  # eos is the argmax at every step

    eager = llm.generate("Hello there", greedy(10, logit_bias=wants_eos))[0].outputs[0]
    held = llm.generate("Hello there", greedy(10, logit_bias=wants_eos, min_tokens=5))[0].outputs[0]

    assert (eager.token_ids, eager.finish_reason, eager.stop_reason) == ([eos], "stop", None)
    assert len(held.token_ids) == 6
    assert eos not in held.token_ids[:5]
    assert (held.token_ids[5], held.finish_reason, held.stop_reason) == (eos, "stop", None)


def test_ignore_eos_generates_through_eos_to_max_tokens(llm):
    eos = llm.get_tokenizer().eos_token_id

    out = llm.generate("Hello there", greedy(7, logit_bias={eos: 100.0}, ignore_eos=True))[0].outputs[0]

    assert (out.token_ids, out.finish_reason) == ([eos] * 7, "length")


def _boundary_stop_string(tokenizer, ids: list[int], text: str) -> tuple[str, int, int]:
    """A 4-character stop string: the last 2 characters of token k and the first 2 of token k + 1.

    Returns (stop, k, position of the boundary in text); the stop string first occurs at that boundary."""
    prefixes = [tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    for k in range(2, len(ids) - 1):
        before, upto, after = prefixes[k], prefixes[k + 1], prefixes[k + 2]
        if not (text.startswith(upto) and text.startswith(after)):
            continue
        pos = len(upto)
        if pos - len(before) < 2 or len(after) - pos < 2:
            continue
        stop = text[pos - 2:pos + 2]
        if text.find(stop) == pos - 2:
            return stop, k, pos
    raise AssertionError(f"no token boundary usable for a stop string in {text!r}")


def test_a_stop_string_spanning_two_tokens_ends_the_text_right_before_it(llm):
    prompt = "The quick brown fox"
    first = llm.generate(prompt, greedy(24))[0].outputs[0]
    stop, k, pos = _boundary_stop_string(llm.get_tokenizer(), first.token_ids, first.text)

    cut = llm.generate(prompt, greedy(24, stop=[stop]))[0].outputs[0]
    kept = llm.generate(prompt, greedy(24, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]

    assert cut.text == first.text[:pos - 2]
    assert stop not in cut.text
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == first.token_ids[:k + 2]  # generation stops at the token completing the string
    assert kept.text == first.text[:pos + 2]
    assert kept.text.endswith(stop)
    assert (kept.finish_reason, kept.stop_reason, kept.token_ids) == ("stop", stop, first.token_ids[:k + 2])


def test_a_stop_token_id_stops_with_reason_stop_and_that_id(llm):
    prompt = "Once upon a time"
    first = llm.generate(prompt, greedy(16))[0].outputs[0]
    stop_id = first.token_ids[4]
    j = first.token_ids.index(stop_id)

    out = llm.generate(prompt, greedy(16, stop_token_ids=[stop_id]))[0].outputs[0]

    assert out.token_ids == first.token_ids[:j + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == llm.get_tokenizer().decode(first.token_ids[:j])  # the stop token's text is left out


# ---- parallel sampling and seeds ----------------------------------------------------------------------------


def test_n_4_shares_the_prompt_blocks_and_returns_indices_0_to_3(llm):
    engine = llm.llm_engine
    prompt = random_prompt(torch.Generator().manual_seed(1), 2 * BLOCK_SIZE + 8)  # 2 full blocks + 8
    engine.add_request("p", prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6))

    engine.step()

    tables = [engine.core.kv.req_to_blocks[f"p-{i}"] for i in range(4)]
    assert [len(t) for t in tables] == [3, 3, 3, 3]
    for i in range(2):
        assert all(t[i] is tables[0][i] for t in tables)
        assert tables[0][i].ref_cnt == 4
    assert len({t[2].block_id for t in tables}) == 4
    assert [t[2].ref_cnt for t in tables] == [1, 1, 1, 1]

    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and final.request_id == "p"
    assert [o.index for o in final.outputs] == [0, 1, 2, 3]
    assert [len(o.token_ids) for o in final.outputs] == [6, 6, 6, 6]
    assert_idle(llm)

    # Child i samples as a lone request seeded seed + i would (vLLM's rule for seeded n > 1).
    alone = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6))[0].outputs[0]
             for i in range(4)]
    assert [o.token_ids for o in final.outputs] == [o.token_ids for o in alone]


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(llm):
    gen = torch.Generator().manual_seed(2)
    target = "In a distant galaxy"
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=12)
    alone = llm.generate(target, sp)[0].outputs[0]

    prompts = [random_prompt(gen, int(torch.randint(3, 60, (1,), generator=gen))) for _ in range(5)]
    others = [SamplingParams(temperature=1.0, max_tokens=int(torch.randint(2, 16, (1,), generator=gen)))
              for _ in range(5)]
    others[1] = SamplingParams(temperature=0.0, max_tokens=9)
    batch = llm.generate(prompts[:2] + [target] + prompts[2:], others[:2] + [sp] + others[2:])

    assert batch[2].outputs[0].token_ids == alone.token_ids
    assert batch[2].outputs[0].text == alone.text


# ---- logprobs -----------------------------------------------------------------------------------------------


def test_greedy_logprobs_match_transformers_log_softmax(llm, tiny_llama):
    hf = tiny_llama[1]
    prompt = random_prompt(torch.Generator().manual_seed(3), 37)

    out = llm.generate(prompt, greedy(10, logprobs=3))[0].outputs[0]

    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = logits.log_softmax(-1)[len(prompt) - 1:-1]
    assert len(out.logprobs) == len(out.token_ids) == 10
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok == int(ref[step].argmax())
        top = ref[step].topk(3).indices.tolist()
        assert list(entry) == top  # the greedy token is the top-1 entry
        assert [entry[t].rank for t in top] == [1, 2, 3]
        for t, lp in entry.items():
            assert abs(lp.logprob - float(ref[step, t])) < 1e-4
    expected_cum = sum(float(ref[i, t]) for i, t in enumerate(out.token_ids))
    assert out.cumulative_logprob == pytest.approx(expected_cum, abs=1e-3)


# ---- aborts and bad input -----------------------------------------------------------------------------------


def test_aborting_a_request_frees_all_its_blocks(llm):
    engine = llm.llm_engine
    prompt = random_prompt(torch.Generator().manual_seed(4), 50)
    engine.add_request("a", prompt, SamplingParams(n=2, temperature=1.0, max_tokens=100))
    engine.step()
    engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_blocks

    engine.abort_request("a")

    assert_idle(llm)


def test_one_prompt_too_long_raises_and_enqueues_nothing(llm):
    good = random_prompt(torch.Generator().manual_seed(5), 10)
    too_long = random_prompt(torch.Generator().manual_seed(6), MAX_MODEL_LEN + 88)

    with pytest.raises(ValueError) as exc:
        llm.generate([good, too_long], greedy(4))

    assert f"prompt has {MAX_MODEL_LEN + 88} tokens" in str(exc.value)
    assert_idle(llm)
    assert len(llm.generate([good], greedy(4))[0].outputs[0].token_ids) == 4


def test_a_bad_second_request_rolls_back_the_first(llm):
    good = random_prompt(torch.Generator().manual_seed(7), 10)

    with pytest.raises(ValueError) as exc:
        llm.generate([good, good], [greedy(4), greedy(4, logit_bias={VOCAB: 1.0})])

    assert "outside the vocabulary" in str(exc.value)
    assert_idle(llm)


# ---- scheduling does not change what is generated -----------------------------------------------------------


def test_preempted_requests_finish_with_the_same_tokens(tiny_llama):
    gen = torch.Generator().manual_seed(8)
    prompts = [random_prompt(gen, 100) for _ in range(4)]  # 4 x 10 blocks at the end > the 32 blocks there are
    roomy = LLM(model=str(tiny_llama[0]), dtype="float32", device="cpu", num_kv_blocks=128)
    tight = LLM(model=str(tiny_llama[0]), dtype="float32", device="cpu", num_kv_blocks=32)

    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, greedy(60, ignore_eos=True))]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy(60, ignore_eos=True))]

    assert tight.llm_engine.stats().num_preemptions > 0
    assert got == expected
    assert_idle(tight)


def test_chunked_prefill_gives_the_same_tokens_as_whole_prefill(tiny_llama):
    gen = torch.Generator().manual_seed(9)
    prompts = [random_prompt(gen, n) for n in (70, 5, 41)]
    whole = LLM(model=str(tiny_llama[0]), dtype="float32", device="cpu", num_kv_blocks=128)
    chunked = LLM(model=str(tiny_llama[0]), dtype="float32", device="cpu", num_kv_blocks=128,
                  max_num_batched_tokens=24)

    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, greedy(12))]
    got = [o.outputs[0].token_ids for o in chunked.generate(prompts, greedy(12))]

    assert got == expected


def test_a_prefix_cache_hit_gives_the_same_tokens_and_counts_the_cached_tokens(llm):
    prompt = random_prompt(torch.Generator().manual_seed(10), 3 * BLOCK_SIZE)  # exactly 3 full blocks

    first = llm.generate(prompt, greedy(8))[0]
    second = llm.generate(prompt, greedy(8))[0]

    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 2 * BLOCK_SIZE)  # last token recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
