"""The llguidance backend of structured outputs (`--structured-outputs-backend guidance`) and auto's fallback to it:
offline on a tiny random model (a JSON schema sampled at temperature 1, under preemption, chunked prefill and the
engine process; choice, regex and EBNF: tests/test_structured_output.py), its token masks against xgrammar's on
SmolLM2's tokenizer, ignore_eos, structural tags, and the errors."""

import json
import re

import jsonschema
import pytest
import torch

from vserve import LLM, SamplingParams, StructuredOutputsParams
from vserve.core.structured_output import GrammarCompiler, StructuredOutputManager

TICKET = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 999},
    "priority": {"enum": ["low", "high"]},
    "owner": {"type": "object", "properties": {"team": {"type": "string", "maxLength": 6}},
              "required": ["team"], "additionalProperties": False},
    "labels": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
    "required": ["id", "priority", "owner", "labels"], "additionalProperties": False}
PROMPTS = [[1, 17, 300, 4000, 12], list(range(100, 170)), [5] * 33, [9, 8, 7]]
NUMS = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


def _json_run(folder, **engine):
    llm = LLM(str(folder), dtype="float32", device="cpu", structured_outputs_backend="guidance",
              **{"max_model_len": 512, **engine})
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=StructuredOutputsParams(
        json=TICKET, disable_any_whitespace=True)) for i in range(len(PROMPTS))]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return [o.token_ids for o in outs], llm, outs


def test_guidance_json_survives_preemption_chunked_prefill_and_the_engine_process(tiny):
    base, llm, outs = _json_run(tiny)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), TICKET)
    # 14 blocks of 16 hold the four sequences (the xgrammar test's count); 10 make the core preempt
    squeezed, small, _ = _json_run(tiny, max_num_batched_tokens=24, num_kv_blocks=10, block_size=16,
                                   max_model_len=160)
    assert small.llm_engine.stats().num_preemptions > 0
    assert squeezed == base
    process, proc, _ = _json_run(tiny, engine_process=True)
    assert process == base
    proc.llm_engine.shutdown()


def _core(tok, params, backend, stops=frozenset({2})):
    gc = GrammarCompiler(tok, 49152, {2}, backend=backend)
    mgr = StructuredOutputManager(49152)
    spec = gc.compile(params)
    assert spec.backend == backend
    mgr.set_tokenizer_info(*gc.tokenizer_info(backend))
    mgr.receive(spec)
    return mgr, mgr.new_state(spec, set(stops))


def _allowed(mgr, state) -> torch.Tensor:
    mask, rows = mgr.bitmask([state])
    assert rows == [0]
    return ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()


@pytest.mark.parametrize("params, text", [(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), "123-abcd"),
                                          (StructuredOutputsParams(grammar=NUMS), "(12,3,45)")])
def test_guidance_masks_equal_xgrammars_along_a_string(default_model_dir, params, text):
    """Both engines' allowed tokens at every position of a string the grammar takes, stop token included (for these
    grammars tokenization does not matter: llguidance may refuse non-canonical tokenizations elsewhere). llguidance
    ends the request at the grammar's last token (nothing but a stop token may follow); xgrammar asks for the stop."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    cores = {b: _core(tok, params, b) for b in ("xgrammar", "guidance")}
    ids = tok.encode(text, add_special_tokens=False)
    for pos, token in enumerate(ids):
        xg, gd = (_allowed(*cores[b]) for b in ("xgrammar", "guidance"))
        assert torch.equal(xg, gd), (pos, (xg != gd).nonzero().flatten()[:10].tolist())
        assert xg[token]
        done = {b: state.accept(token) for b, (_, state) in cores.items()}
        assert done == {"xgrammar": False, "guidance": pos == len(ids) - 1}, (pos, done)
    mgr, state = cores["guidance"]
    assert state.has_mask() and _allowed(mgr, state).nonzero().flatten().tolist() == [2]  # only the stop token


def test_ignore_eos_clears_the_stop_token_where_the_grammar_could_end(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    params = StructuredOutputsParams(regex=r"[0-9]{1,3}")
    for stops, eos_allowed in (({2}, True), (set(), False)):
        mgr, state = _core(tok, params, "guidance", stops)
        assert not state.accept(tok.convert_tokens_to_ids("7"))
        allowed = _allowed(mgr, state)
        assert allowed[tok.convert_tokens_to_ids("8")]  # "78" goes on
        assert bool(allowed[2]) is eos_allowed, stops


def test_auto_falls_back_to_guidance_where_xgrammar_refuses(tiny, default_model_dir):
    """A case-insensitive regex: xgrammar has no flag groups, llguidance has. auto compiles it with llguidance;
    xgrammar alone is a clear error; a grammar neither takes (a backreference) is xgrammar's error under auto."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    insensitive = StructuredOutputsParams(regex=r"(?i)(yes|no)")
    assert GrammarCompiler(tok, 49152, {2}).compile(insensitive).backend == "guidance"
    assert GrammarCompiler(tok, 49152, {2}).compile(StructuredOutputsParams(regex="[a-z]+")).backend == "xgrammar"
    with pytest.raises(ValueError, match="regex structured output does not compile: .*not supported"):
        GrammarCompiler(tok, 49152, {2}, backend="xgrammar").compile(insensitive)
    with pytest.raises(ValueError, match="does not compile: .*Backreference"):
        GrammarCompiler(tok, 49152, {2}).compile(StructuredOutputsParams(regex=r"(a)\1"))

    # one batch of both engines' rows: 8 xgrammar rows (its batch matcher, at the rows between) and 2 llguidance ones
    llm = LLM(str(tiny), dtype="float32", device="cpu", max_model_len=256)  # auto, the default
    digits = SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{2,4}"))
    outs = llm.generate([[5, 6, 7]] * 3, [
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured_outputs=insensitive), digits,
        SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured_outputs=insensitive)], use_tqdm=False)
    for out, pattern in zip(outs, (r"(?i)(yes|no)", "[0-9]{2,4}", r"(?i)(yes|no)")):
        for o in out.outputs:
            assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), (pattern, o.text)
    assert len(outs[1].outputs) == 8


def test_guidance_errors_name_the_problem(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    gc = GrammarCompiler(tok, 49152, {2}, backend="guidance")
    # llguidance refuses a keyword it cannot enforce rather than ignoring it
    with pytest.raises(ValueError, match=r"json structured output does not compile \(llguidance\).*not"):
        gc.compile(StructuredOutputsParams(json={"type": "string", "not": {"const": "a"}}))
    with pytest.raises(ValueError, match="schema is not valid JSON"):
        gc.compile(StructuredOutputsParams(json='{"type": '))
    with pytest.raises(ValueError, match="KeyError: 'end'"):  # a 400 naming the missing key, not a 500
        gc.compile(StructuredOutputsParams(structural_tag={"structures": [{"begin": "<a>"}], "triggers": ["<a"]}))
    with pytest.raises(ValueError, match="structural tags as"):
        gc.compile(StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {}}))
    with pytest.raises(ValueError, match="--structured-outputs-backend must be one of auto, xgrammar, guidance"):
        LLM(structured_outputs_backend="outlines")


def test_guidance_structural_tag_constrains_the_tagged_call(default_model_dir):
    """vLLM's structural tag form: free text until a trigger, then the tag's begin, JSON of its schema and its end."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tag = {"type": "structural_tag", "triggers": ["<fn="], "structures": [
        {"begin": "<fn=add>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                         "required": ["a"], "additionalProperties": False}, "end": "</fn>"}]}
    mgr, state = _core(tok, StructuredOutputsParams(structural_tag=tag), "guidance")
    for token in tok.encode('Sum: <fn=add>{"a": 4}</fn>', add_special_tokens=False):
        assert _allowed(mgr, state)[token]
        assert not state.accept(token) or state.matcher.is_accepting()
    assert not state.matcher.is_error()
    _, bad = _core(tok, StructuredOutputsParams(structural_tag=tag), "guidance")
    ids = tok.encode('<fn=add>{"b": 4}', add_special_tokens=False)
    assert any(not bad.matcher.consume_token(t) for t in ids)  # "b" is not the schema's
