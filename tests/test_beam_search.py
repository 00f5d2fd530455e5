"""Beam search: `LLM.beam_search` returns HF transformers' `generate(num_beams=...)` hypotheses and scores (tiny random
models, float32; EOS made likely so hypotheses finish early and length_penalty and early stopping decide), the beams
share cached prompt blocks, and /v1/completions' use_beam_search returns the same sequences."""

import shutil

import httpx
import pytest
import torch

from vserve import LLM, BeamSearchParams

EOS = 2
PROMPTS = [[5, 9, 13, 40, 22], [17, 3, 60, 8, 8, 31, 12], list(range(10, 50))]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, default_model_dir):
    """A random Llama with a 64-token vocabulary whose EOS row of the LM head is scaled up: EOS is often among the
    top candidates, so hypotheses of different lengths compete."""
    import transformers
    from conftest import TOKENIZER_FILES, _config

    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(_config("llama", vocab_size=64), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 3
    folder = tmp_path_factory.mktemp("tiny-eos")
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def llm(eos_model):
    return LLM(str(eos_model), dtype="float32", device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def hf_beams(eos_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(eos_model, dtype=torch.float32).eval()

    def run(prompt, width, length_penalty, early_stopping):
        """(generated tokens up to and with EOS, score) of each returned hypothesis, best first."""
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                               length_penalty=length_penalty, early_stopping=early_stopping,
                               max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                               return_dict_in_generate=True, output_scores=True)
        out = []
        for row, score in zip(g.sequences.tolist(), g.sequences_scores.tolist()):
            gen = row[len(prompt):]
            out.append((gen[:gen.index(EOS) + 1] if EOS in gen else gen, score))
        return out

    return run


RUNS: dict = {}  # (width, length_penalty, early_stopping) -> the generated tokens per prompt, for the last test


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [0.5, 2.0])
@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_hf(llm, hf_beams, width, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    got_all = []
    for p, out in zip(PROMPTS, outs):
        ref = hf_beams(p, width, length_penalty, early_stopping)
        got = [s.tokens[len(p):] for s in out.sequences]
        assert all(s.tokens[:len(p)] == p for s in out.sequences)
        assert got == [g for g, _ in ref], f"prompt {p[:4]}..: width {width}, length_penalty {length_penalty}"
        assert [s.score for s in out.sequences] == pytest.approx([sc for _, sc in ref], abs=1e-4)
        for s in out.sequences:
            gen_len = len(s.tokens) - len(p)
            assert s.score == pytest.approx(s.cum_logprob / gen_len ** length_penalty, abs=1e-6)
            assert s.finish_reason == ("stop" if s.tokens[-1] == EOS else "length")
        got_all.append(got)
    RUNS[(width, length_penalty, early_stopping)] = got_all


def test_the_parity_cases_exercise_eos_and_stopping():
    """The cases above are not all max-length beams: hypotheses end at EOS at several lengths, and the stopping
    rule and length penalty change what is returned."""
    if len(RUNS) < 12:
        pytest.skip("runs with the parity tests")
    seqs = [s for got in RUNS.values() for per_prompt in got for s in per_prompt]
    assert len({len(s) for s in seqs if s[-1] == EOS}) >= 3
    assert RUNS[(2, 2.0, False)] != RUNS[(2, 2.0, True)] != RUNS[(2, 2.0, "never")]
    assert RUNS[(4, 0.5, False)] != RUNS[(4, 2.0, False)]


def test_beams_share_cached_prompt_blocks(llm):
    core = llm.llm_engine.core
    before = core.kv.prefix_cache_hits
    prompt = list(range(3, 60))  # three full blocks of 16
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=4, max_tokens=4,
                                                                           ignore_eos=True))[0]
    assert len(out.sequences) == 4 and all(len(s.tokens) == len(prompt) + 4 for s in out.sequences)
    # every step after the first: each of 4 beams reads the prompt's 3 cached blocks instead of recomputing them
    assert core.kv.prefix_cache_hits - before >= 3 * 4 * 3 * 16
    assert core.kv.num_free_blocks() == core.kv.pool.num_blocks  # idle again: every reference was dropped


@pytest.mark.parametrize("kwargs, match", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width must be >= 1"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": 0.7}, "temperature must be 0"),
    ({"beam_width": 2, "max_tokens": 4, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_bad_beam_search_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_beam_width_beyond_the_vocabulary_is_a_value_error(llm):
    with pytest.raises(ValueError, match="too large for a vocabulary of 64"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=40, max_tokens=2))


def test_completions_use_beam_search_equals_offline(server_factory, eos_model, llm, tmp_path):
    server = server_factory([str(eos_model), "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
                             "--max-model-len", "256"], tmp_path / "server.log")
    prompt = PROMPTS[1]
    offline = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=0.5))[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "use_beam_search": True, "best_of": 4,
            "n": 2, "length_penalty": 0.5, "temperature": 0, "logprobs": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for c, seq in zip(choices, offline.sequences[:2]):
        gen = seq.tokens[len(prompt):]
        assert len(c["logprobs"]["tokens"]) == len(gen)
        assert c["finish_reason"] == seq.finish_reason
        assert sum(c["logprobs"]["token_logprobs"]) == pytest.approx(seq.cum_logprob, abs=1e-4)
    bad = httpx.post(server.url + "/v1/completions", json={**body, "stream": True})
    assert bad.status_code == 400 and "stream" in bad.json()["error"]["message"]


# ---- under a structured output ----------------------------------------------------------------------------------
REGEX = "[a-e]{2,6}"


@pytest.fixture(scope="module")
def grammar_setup(tiny_model):
    """A tiny random Llama with SmolLM2's tokenizer (every letter and many letter runs are tokens), its vserve LLM
    and the regex compiled by xgrammar for the HF reference's mask."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    folder = tiny_model("llama")
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=256)
    stops = sorted(llm.llm_engine.processor.stop_token_ids)
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = llm.llm_engine.processor.model_config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=stops)
    return folder, llm, stops, xgr.GrammarCompiler(info).compile_regex(REGEX), tok


def _hf_grammar_beams(folder, compiled, stops, prompt, width, length_penalty, max_tokens):
    """HF generate(num_beams=width) with a logits processor that sets the grammar's disallowed tokens to -inf (each
    row's matcher replayed from its generated tokens, so beam reordering cannot confuse it)."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class Mask(LogitsProcessor):
        def __call__(self, input_ids, scores):
            bitmask = xgr.allocate_token_bitmask(input_ids.shape[0], scores.shape[1])
            for row, ids in enumerate(input_ids[:, len(prompt):].tolist()):
                m = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
                for t in ids:
                    assert m.accept_token(t)
                m.fill_next_token_bitmask(bitmask, row)
            xgr.apply_token_bitmask_inplace(scores, bitmask)
            return scores

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                           length_penalty=length_penalty, max_new_tokens=max_tokens, do_sample=False,
                           eos_token_id=stops, pad_token_id=0, logits_processor=LogitsProcessorList([Mask()]))
    out = []
    for row in g.tolist():
        gen = row[len(prompt):]
        end = next((i for i, t in enumerate(gen) if t in stops), None)
        out.append(gen if end is None else gen[:end + 1])
    return out


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (3, 0.5)])
def test_beam_search_under_a_grammar_equals_hf_with_the_mask(grammar_setup, width, length_penalty):
    import re

    from vserve import StructuredOutputsParams

    folder, llm, stops, compiled, tok = grammar_setup
    prompts = [[1, 17, 300, 4000, 12], list(range(100, 130))]
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty,
                              structured_outputs=StructuredOutputsParams(regex=REGEX))
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        got = [s.tokens[len(p):] for s in out.sequences]
        assert got == _hf_grammar_beams(folder, compiled, stops, p, width, length_penalty, 10)
        for s, gen in zip(out.sequences, got):  # every hypothesis is the regex's, closed by EOS
            assert s.finish_reason == "stop" and gen[-1] in stops
            assert re.fullmatch(REGEX, tok.decode(gen[:-1])), tok.decode(gen[:-1])
    assert llm.llm_engine.core.kv.num_free_blocks() == llm.llm_engine.core.kv.pool.num_blocks


def test_beam_search_under_a_grammar_needs_eos():
    from vserve import StructuredOutputsParams

    with pytest.raises(ValueError, match="ignore_eos must be False"):
        BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True,
                         structured_outputs=StructuredOutputsParams(regex="[ab]+"))


def test_completions_use_beam_search_with_structured_outputs_equals_offline(server_factory, grammar_setup, tmp_path):
    from vserve import StructuredOutputsParams

    folder, llm, stops, _, tok = grammar_setup
    server = server_factory([str(folder), "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
                             "--max-model-len", "256"], tmp_path / "server.log")
    prompt = list(range(100, 130))
    offline = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5,
                                                         structured_outputs=StructuredOutputsParams(regex=REGEX)))[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "use_beam_search": True, "best_of": 3, "n": 3,
            "length_penalty": 0.5, "temperature": 0, "structured_outputs": {"regex": REGEX}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [tok.decode(s.tokens[len(prompt):-1]) for s in offline.sequences]
    assert all(c["finish_reason"] == "stop" for c in r.json()["choices"])
