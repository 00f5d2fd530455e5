"""Structured outputs (xgrammar): the offline engine under chunked prefill, preemption, async scheduling and the engine
process; the OpenAI API through the real openai SDK against `vserve serve` on the embedded SmolLM2 (CPU): JSON
schemas sampled at temperature 1 and validated, json_object, parse() with pydantic, regex / choice / grammar through
structured_outputs and the deprecated guided_* fields, streaming, forced tool calls; and the 400s."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest

from vserve import LLM, SamplingParams, StructuredOutputsParams
from vserve.core.structured_output import GrammarCompiler

# Bounded schemas (string lengths, integer ranges, array sizes): every completion ends within max_tokens.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"type": "string", "enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "color", "tags"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1000, "maximum": 9999},
    "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "express": {"type": "boolean"}},
    "required": ["id", "items", "express"], "additionalProperties": False}
REPORT = {"type": "object", "properties": {  # seed 000's medical report, bounded
    "patient": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 110},
                                                 "sex": {"enum": ["female", "male", "other"]}},
                "required": ["age", "sex"], "additionalProperties": False},
    "severity": {"enum": ["mild", "moderate", "severe"]},
    "findings": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 10}}},
    "required": ["patient", "severity", "findings"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
    "additionalProperties": False}}}


# ---- offline --------------------------------------------------------------------------------------------------
def _json_params(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                          structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), **kw)


PROMPTS = [[1, 17, 300, 4000, 12], list(range(100, 170)), [5] * 33, [9, 8, 7]]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


def _run(folder, **engine) -> tuple[list[list[int]], LLM, list]:
    llm = LLM(str(folder), dtype="float32", device="cpu", **{"max_model_len": 512, **engine})
    outs = llm.generate(PROMPTS, [_json_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm, [o.outputs[0] for o in outs]


def test_constrained_request_survives_preemption_chunked_prefill_async_and_engine_process(tiny):
    """A random model's seeded samples: every one is valid JSON of the schema, and the tokens are the same when the
    prompts are chunked and the requests preempted, under async scheduling, and through the engine process."""
    base, llm, outs = _run(tiny)
    for out in outs:
        assert out.finish_reason == "stop"  # the grammar ended it: a stop token, allowed only at its end
        assert out.token_ids[-1] in llm.llm_engine.stop_token_ids
        jsonschema.validate(json.loads(out.text), PERSON)
    squeezed, small, _ = _run(tiny, max_num_batched_tokens=24, num_kv_blocks=14, block_size=16, max_model_len=200)
    assert small.llm_engine.stats().num_preemptions > 0
    assert squeezed == base
    overlapped, _, _ = _run(tiny, async_scheduling=True)
    assert overlapped == base
    process, proc, _ = _run(tiny, engine_process=True)
    assert process == base
    proc.llm_engine.shutdown()


@pytest.mark.parametrize("backend", ["auto", "guidance"])  # auto: xgrammar for these (llguidance: its own tests too)
def test_choice_regex_and_grammar_offline_with_n(tiny, backend):
    llm = LLM(str(tiny), dtype="float32", device="cpu", max_model_len=256, structured_outputs_backend=backend)
    tok = llm.get_tokenizer()
    choice = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "a \"quoted\" one"]))
    regex = SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True,
                           structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"))
    ebnf = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(
        grammar='root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'))
    outs = llm.generate([[5, 6, 7]] * 3, [choice, regex, ebnf], use_tqdm=False)
    assert len(outs[0].outputs) == 4
    assert {o.text for o in outs[0].outputs} <= {"yes", "no", 'a "quoted" one'}
    assert all(o.finish_reason == "stop" for out in outs for o in out.outputs)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[1].outputs[0].text)
    assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", outs[2].outputs[0].text)
    # ignore_eos: the grammar ends the request without a stop token (llguidance: the stop token is cleared from the
    # mask), so the token ids are exactly the text's
    assert tok.decode(outs[1].outputs[0].token_ids) == outs[1].outputs[0].text


def test_grammar_starts_after_the_reasoning_end_token(tiny):
    """start_after_token_id (the server sets it to </think> with --reasoning-parser): nothing is constrained until
    that token is sampled, then the grammar applies. A logit bias makes the random model write the token first."""
    llm = LLM(str(tiny), dtype="float32", device="cpu", max_model_len=256)
    end = 4000
    so = StructuredOutputsParams(regex=r"[0-9]{4}", start_after_token_id=end)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, logit_bias={end: 100.0},
                                                  structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == end and out.finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{4}", llm.get_tokenizer().decode(out.token_ids[1:], skip_special_tokens=True))
    # the bias still favours the token afterwards: only the grammar keeps it out
    assert end not in out.token_ids[1:]


def test_beam_search_with_a_structured_output_keeps_every_beam_in_the_grammar(server):
    """The deprecated guided_regex with use_beam_search on the real SmolLM2 (tests/test_beam_search.py checks the
    hypotheses against HF's masked beam search)."""
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "Say yes or no:",
                                                         "use_beam_search": True, "n": 2, "max_tokens": 8,
                                                         "guided_regex": "(yes|no)!{0,2}"}, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(re.fullmatch("(yes|no)!{0,2}", c["text"]) for c in choices), choices
    assert all(c["finish_reason"] == "stop" for c in choices)


def test_the_core_gets_each_compiled_grammar_once_and_forgets_what_the_front_end_drops(default_model_dir):
    """Only the first request of a key carries its compiled grammar (megabytes for a long string's minLength); the
    front end tells the core to forget its least recently used key beyond max_cached; replaying the commands in order,
    the core has every grammar a request needs."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from vserve.core.structured_output import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    gc = GrammarCompiler(tok, 49152, {2}, max_cached=2)
    mgr = StructuredOutputManager(49152)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    sent = []
    for params in (a, a, b, a, c, b, a):
        req = SimpleNamespace(structured=gc.compile(params))
        before, after = gc.core_commands([req])
        sent.append((before, req.structured, after))
        for kind, arg in before:
            assert kind == "grammar_info"
            mgr.set_tokenizer_info(*arg)
        mgr.receive(req.structured)
        st = mgr.new_state(req.structured, {2})
        assert st.matcher.accept_string(params.regex[0] * 3)
        for kind, arg in after:
            assert kind == "forget_grammar"
            mgr.forget(arg)
    assert [bool(b) for b, _, _ in sent] == [True] + [False] * 6  # the tokenizer's info once
    assert [spec.compiled is not None for _, spec, _ in sent] == [True, False, True, False, True, True, True]
    # c evicts b (a was used after b); then b comes back and evicts a, which comes back and evicts c
    assert [after for _, _, after in sent] == [[], [], [], [], [("forget_grammar", b.key())], [
        ("forget_grammar", a.key())], [("forget_grammar", c.key())]]
    assert set(mgr._grammars) == {a.key(), b.key()}


def test_grammar_cache_compiles_once_and_bad_grammars_are_value_errors(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    gc = GrammarCompiler(tok, 49152, {2})  # auto: these bad ones are bad for llguidance too (xgrammar's message)
    a = gc.compile(StructuredOutputsParams(json=PERSON))
    b = gc.compile(StructuredOutputsParams(json=json.dumps(PERSON, indent=2)))  # the same schema, as text
    c = gc.compile(StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))  # another grammar
    assert b.compiled is a.compiled and c.key != a.key
    assert len(gc.compile_seconds) == 2 and gc.num_requests == 3
    for bad, msg in ((dict(json={"type": "objec"}), "Unsupported type"), (dict(regex="("), "not closed"),
                     (dict(grammar='root ::= "a" ('), "EBNF"), (dict(json="{not json"), "not valid JSON")):
        with pytest.raises(ValueError, match=msg):
            gc.compile(StructuredOutputsParams(**bad))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_bitmask_fill_threads_leave_cores_and_take_the_override(monkeypatch):
    import os

    from vserve.core.structured_output import fill_threads

    monkeypatch.delenv("VSERVE_GRAMMAR_THREADS", raising=False)
    assert fill_threads() == max(1, min(8, len(os.sched_getaffinity(0)) // 2))
    monkeypatch.setenv("VSERVE_GRAMMAR_THREADS", "3")
    assert fill_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("VSERVE_GRAMMAR_THREADS", bad)
        with pytest.raises(ValueError, match="VSERVE_GRAMMAR_THREADS must be a positive integer"):
            fill_threads()


def _person_core(model_dir):
    """SmolLM2's tokenizer, a core-side manager holding PERSON's grammar, and its spec."""
    from transformers import AutoTokenizer

    from vserve.core.structured_output import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    gc = GrammarCompiler(tok, 49152, {2})
    mgr = StructuredOutputManager(49152)
    mgr.set_tokenizer_info(*gc.tokenizer_info("xgrammar"))
    spec = gc.compile(StructuredOutputsParams(json=PERSON))
    mgr.receive(spec)
    return tok, mgr, spec


def test_length_bounded_json_strings_refuse_control_characters(default_model_dir):
    """xgrammar 0.2.9 writes a string with maxLength as a count of [^"\\\r\n], so a sampled tab or \x01 went raw into
    the JSON string (json.loads refused the output at temperature 1); vserve's grammar refuses them, token by token
    too, and still takes what the schema allows."""
    import torch
    import xgrammar as xgr

    tok, mgr, spec = _person_core(default_model_dir)
    for bad in ('{"name": "a\tb"', '{"name": "\x01', '{"name": "x", "age": 1, "color": "red", "tags": ["\x1f'):
        assert not mgr.new_state(spec, {2}).matcher.accept_string(bad), repr(bad)
    good = mgr.new_state(spec, {2})
    assert good.matcher.accept_string('{"name": "Al Bo", "age": 120, "color": "red", "tags": ["a b", "c"]}')
    assert good.accept(2)  # complete: its stop token terminates it
    inside = mgr.new_state(spec, {2})
    assert inside.matcher.accept_string('{"name": "Al')
    mask = xgr.allocate_token_bitmask(1, 49152)
    inside.matcher.fill_next_token_bitmask(mask, 0)
    control = [i for i in range(len(tok)) if any(0 <= ord(c) < 32 for c in tok.decode([i]))]
    assert control and not any(mask[0, i // 32].item() >> (i % 32) & 1 for i in control)
    assert torch.any(mask != 0)


def test_bitmask_of_many_rows_filled_on_threads_equals_one_row_at_a_time(default_model_dir):
    """From 8 constrained rows the core fills the masks with xgrammar's batch matcher; the same words as filling
    each row alone, rows without a grammar or with a finished one left out."""
    import torch
    import xgrammar as xgr

    tok, mgr, spec = _person_core(default_model_dir)
    prefixes = ['{"name": "Al', '{', '{"name": "Bo", "age": 4', '{"name": "", "age": 7, "color": "re', "",
                '{"name": "x", "age": 1, "color": "red", "tags": [', '{"name": "Cy"', '{"name": "D", "age": 120']
    states = []
    for p in prefixes * 2:
        st = mgr.new_state(spec, {2})
        assert st.matcher.accept_string(p)
        states.append(st)
    done = mgr.new_state(spec, {2})
    assert done.matcher.accept_string('{"name": "E", "age": 1, "color": "red", "tags": []}')
    assert done.accept(2)  # its stop token: terminated
    states[3:3] = [None, done]
    mask, rows = mgr.bitmask(states)
    assert rows == [i for i, st in enumerate(states) if st is not None and st is not done]
    for j, i in enumerate(rows):
        one = xgr.allocate_token_bitmask(1, 49152)
        states[i].matcher.fill_next_token_bitmask(one, 0)
        assert torch.equal(mask[j], one[0])


# ---- the server -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    return server_factory(["--served-model-name", "m", "--device", "cpu", "--max-model-len", "1024",
                           "--max-num-seqs", "64", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                           "--reasoning-parser", "qwen3"], log, timeout=300)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _chat(client, content: str, **kw):
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], **kw)


def test_json_schemas_sampled_at_temperature_1_all_validate(client):
    """3 schemas x 20 completions (n=20), sent together so the engine batches them."""
    def ask(name, schema):
        return _chat(client, f"Write a {name} as JSON.", n=20, temperature=1.0, max_tokens=400,
                     response_format={"type": "json_schema",
                                      "json_schema": {"name": name, "schema": schema, "strict": True}})

    cases = (("person", PERSON), ("order", ORDER), ("report", REPORT))
    with ThreadPoolExecutor(3) as pool:
        results = {name: pool.submit(ask, name, schema) for name, schema in cases}
    for name, schema in cases:
        choices = results[name].result().choices
        assert len(choices) == 20
        for ch in choices:
            assert ch.finish_reason == "stop", ch.message.content
            jsonschema.validate(json.loads(ch.message.content), schema)


def test_json_object_parse_regex_choice_grammar_and_guided_aliases(client):
    r = _chat(client, "Reply with a JSON object describing a cat.", temperature=0.7, seed=1, max_tokens=300,
              response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=120)

    parsed = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "A person."}],
                                           response_format=Person, temperature=0.8, seed=2, max_tokens=80)
    assert isinstance(parsed.choices[0].message.parsed, Person)

    for extra in ({"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{4}"}}, {"guided_regex": r"[A-Z]{2}-[0-9]{4}"}):
        r = _chat(client, "A code:", temperature=1.0, seed=5, max_tokens=20, extra_body=extra)
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", r.choices[0].message.content)
    for extra in ({"structured_outputs": {"choice": ["positive", "negative"]}},
                  {"guided_choice": ["positive", "negative"]}):
        r = client.completions.create(model="m", prompt="Sentiment of 'great movie':", max_tokens=10,
                                      temperature=1.0, extra_body=extra)
        assert r.choices[0].text in ("positive", "negative")
    gbnf = 'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{2,6}'
    for extra in ({"structured_outputs": {"grammar": gbnf}}, {"guided_grammar": gbnf}):
        r = _chat(client, "Greet someone.", temperature=1.0, max_tokens=20, extra_body=extra)
        assert re.fullmatch(r"(hello|hi) [a-z]{2,6}", r.choices[0].message.content)
    r = _chat(client, "A person.", temperature=1.0, max_tokens=200, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_streaming_under_a_schema_concatenates_to_valid_json(client):
    stream = _chat(client, "A person as JSON.", temperature=1.0, seed=7, max_tokens=200, stream=True,
                   response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), PERSON)


def test_forced_tool_calls_required_and_named_have_valid_arguments(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris and the time in Berlin?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                       temperature=1.0, seed=11, max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in ch.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("call_")
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER, TIME], temperature=1.0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=100, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    # the call goes back into the conversation with the tool's answer: the template renders both
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    r = client.chat.completions.create(model="m", messages=follow, max_tokens=5)
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_in_the_sdk(client, tool_choice):
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    with client.chat.completions.stream(model="m", messages=msgs, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                        temperature=1.0, seed=13, max_tokens=200) as stream:
        names = [e.name for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and names == [c.function.name for c in calls]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("body, status, needle", [
    ({"structured_outputs": {"json": {"type": "objec"}}}, 400, "Unsupported type"),
    ({"guided_regex": "("}, 400, "not closed"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "json_schema.schema"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, 400, "one structured output"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "exactly one"),
    ({"structured_outputs": {"jsn": {}}}, 400, "structured_outputs.jsn"),
    ({"temprature": 0.5}, 400, "temprature"),
    ({"tool_choice": "required", "tools": [WEATHER], "parallel_tool_calls": False, "response_format": {
        "type": "json_object"}}, 400, "one structured output"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, 400, "nope"),
    ({"store": True, "metadata": {"k": "v"}, "max_tokens": 1}, 200, ""),  # the documented allow-list
])
def test_bad_structured_requests_and_unknown_fields_are_400(server, body, status, needle):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, timeout=120)
    assert r.status_code == status, r.text
    if status == 400:
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_metrics_count_structured_requests_and_compile_times(server, client):
    _chat(client, "A code:", max_tokens=10, extra_body={"guided_regex": "[a-z]{3}"})
    text = httpx.get(server.url + "/metrics").text
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("vserve:structured_output_requests_total{"))
    compiles = next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("vserve:structured_output_compile_seconds_count{"))
    assert count >= 1 and compiles >= 1


# The model does not call tools or think by itself: a regex makes it write what Qwen (hermes tool calls, <think>)
# writes, and the parsers of the server's flags turn that into tool_calls and reasoning. (The grammar lets it spell
# the fixed text with any tokens, single characters too: max_tokens leaves room for that.)
HERMES = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "c"\}\}\n'
          r'</tool_call>')
THINK = r"<think>\nwarm or cold\n</think>\n\n(hot|cold)"


def test_auto_tool_choice_parses_hermes_calls_plain_and_streamed(client):
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER], max_tokens=200,
                                       extra_body={"guided_regex": HERMES})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure."
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "c"}
    with client.chat.completions.stream(model="m", messages=msgs, tools=[WEATHER], max_tokens=200,
                                        extra_body={"guided_regex": HERMES}) as stream:
        final = stream.get_final_completion()
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})]


def test_reasoning_parser_splits_thinking_plain_and_streamed(client):
    msgs = [{"role": "user", "content": "Hot or cold?"}]
    r = _chat(client, "Hot or cold?", max_tokens=200, temperature=0, extra_body={"guided_regex": THINK})
    msg = r.choices[0].message
    assert msg.content in ("hot", "cold")
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "warm or cold"
    stream = client.chat.completions.create(model="m", messages=msgs, max_tokens=200, stream=True, temperature=0,
                                            extra_body={"guided_regex": THINK})
    reasoning, content = [], []
    for chunk in stream:
        for ch in chunk.choices:
            reasoning.append((ch.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(ch.delta.content or "")
    assert "".join(reasoning) == "warm or cold" and "".join(content) == msg.content


def test_auto_tool_choice_needs_the_servers_flags():
    from vserve.core.server.app import ServerSettings
    from vserve.core.server.chat_output import ChatOutputParser
    from vserve.core.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        ChatOutputParser.for_request(body, ServerSettings("m"), None)
    named = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert ChatOutputParser.for_request(named, ServerSettings("m"), None).mode == "named"
