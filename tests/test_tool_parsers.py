"""Tool-call parsers on outputs written from each format's documentation: whole and streamed in random fragments,
a stream reassembled as the openai SDK does equals the whole-text result."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vserve.core.tool_parsers import (
    TOOL_PARSERS,
    DeltaToolCall,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'
UNICODE_ARGS = {"city": "Zürich", "note": "天気は? ☀️", "quote": 'say "hi"\n'}
NESTED_ARGS = {"filter": {"tags": ["a", "b"], "range": {"min": 1, "max": 2.5}}, "limit": None, "exact": True}

# (parser, model output, expected calls as (name, arguments), expected content)
CASES = [
    # hermes: Qwen2.5 / Qwen3 / Hermes
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>",
     [("get_weather", {"city": "Paris", "unit": "celsius"})], None),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})], None),
    ("hermes", f"I'll look that up for you.\n\n<tool_call>\n{WEATHER}\n</tool_call>",
     [("get_weather", {"city": "Paris", "unit": "celsius"})], "I'll look that up for you."),
    ("hermes", "The capital of France is Paris.", [], "The capital of France is Paris."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
     [], '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{broken\n</tool_call>",
     [("get_weather", {"city": "Paris", "unit": "celsius"})], "<tool_call>\n{broken\n</tool_call>"),
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(UNICODE_ARGS, ensure_ascii=False)}}}'
     "\n</tool_call>", [("get_weather", UNICODE_ARGS)], None),
    ("hermes", f'<tool_call>\n{{"arguments": {json.dumps(NESTED_ARGS)}, "name": "search"}}\n</tool_call>',
     [("search", NESTED_ARGS)], None),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', [("get_time", {})], None),  # stopped early
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
     [], '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 3000 + "</tool_call>",
     [], '<tool_call>{"name": "f", "arguments": ' + "[" * 3000 + "</tool_call>"),
    ("hermes", "Wrap calls in <tool_ tags", [], "Wrap calls in <tool_ tags"),
    ("hermes", "It ends with <tool_", [], "It ends with <tool_"),
    # llama3_json: Llama 3.1+
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     [("get_weather", {"city": "Paris", "unit": "celsius"})], None),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": {"timezone": "UTC"}}',
     [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})], None),
    ("llama3_json", "Paris is the capital of France.", [], "Paris is the capital of France."),
    ("llama3_json", 'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}',
     [], 'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}',
     [], '{"name": "get_weather", "parameters": {"city": "Paris"}'),
    ("llama3_json", '{"answer": 42}', [], '{"answer": 42}'),
    ("llama3_json", '{"name": "f", "parameters": {"n": ' + "9" * 5000 + "}}",
     [], '{"name": "f", "parameters": {"n": ' + "9" * 5000 + "}}"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}\nLet me know if that helps.',
     [("get_weather", {"city": "Paris"})], "Let me know if that helps."),
    ("llama3_json", f'{{"name": "lookup", "parameters": {json.dumps(UNICODE_ARGS, ensure_ascii=False)}}}',
     [("lookup", UNICODE_ARGS)], None),
    ("llama3_json", f'{{"name": "search", "parameters": {json.dumps(NESTED_ARGS)}}}', [("search", NESTED_ARGS)], None),
    # mistral: JSON array after [TOOL_CALLS], or name[ARGS]{...} with v11+ tokenizers
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     [("get_weather", {"city": "Paris", "unit": "celsius"})], None),
    ("mistral", f"[TOOL_CALLS] [{WEATHER}, {TIME}]",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})], None),
    ("mistral", f"Let me check both.[TOOL_CALLS][{WEATHER}]",
     [("get_weather", {"city": "Paris", "unit": "celsius"})], "Let me check both."),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}',
     [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})], None),
    ("mistral", "Bonjour ! Comment puis-je vous aider ?", [], "Bonjour ! Comment puis-je vous aider ?"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',
     [], '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]'),
    ("mistral", '[TOOL_CALLS][{"city": "Paris"}]', [], '[TOOL_CALLS][{"city": "Paris"}]'),
    ("mistral", f"[TOOL_CALLS]lookup[ARGS]{json.dumps(UNICODE_ARGS, ensure_ascii=False)}",
     [("lookup", UNICODE_ARGS)], None),
    ("mistral", f'[TOOL_CALLS][{{"name": "search", "arguments": {json.dumps(NESTED_ARGS)}}}]',
     [("search", NESTED_ARGS)], None),
    # pythonic: Llama 3.2 / Llama 4
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]',
     [("get_weather", {"city": "Paris", "unit": "celsius"})], None),
    ("pythonic", '[get_weather(city="Paris"), get_time(timezone="UTC", offset=-1.5)]',
     [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC", "offset": -1.5})], None),
    ("pythonic", "Paris is the capital of France.", [], "Paris is the capital of France."),
    ("pythonic", "[1] Smith et al., 2020.", [], "[1] Smith et al., 2020."),
    ("pythonic", 'Sure: [get_weather(city="Paris")]', [], 'Sure: [get_weather(city="Paris")]'),
    ("pythonic", "[get_weather(city=input())]", [], "[get_weather(city=input())]"),
    ("pythonic", '[get_weather("Paris")]', [], '[get_weather("Paris")]'),
    ("pythonic", '[get_weather(city="Paris"', [], '[get_weather(city="Paris"'),
    ("pythonic", '[lookup(city="Zürich", note="天気は? ☀️", quote="say \\"hi\\"\\n")]',
     [("lookup", UNICODE_ARGS)], None),
    ("pythonic", '[search(filter={"tags": ["a", "b"], "range": {"min": 1, "max": 2.5}}, limit=None, exact=True)]',
     [("search", NESTED_ARGS)], None),
]
CASE_IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]


def fragments(text: str, seed: int) -> list[str]:
    """`text` cut at random places; seed 0 cuts after every character."""
    rng = random.Random(seed)
    pieces, pos = [], 0
    while pos < len(text):
        size = 1 if seed == 0 else rng.randint(1, 12)
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


def stream(parser, pieces: list[str]) -> tuple[list[dict], str | None]:
    """Feed `pieces`, then finish; reassemble as the openai SDK does (per index: id and name from the first delta,
    arguments concatenated), checking each delta has OpenAI's shape."""
    calls: list[dict] = []
    content = ""
    deltas = [parser.extract_tool_calls_streaming(p) for p in pieces] + [parser.finish_streaming()]
    for delta in deltas:
        if delta is None:
            continue
        assert delta.content or delta.tool_calls, "an empty delta is sent as None"
        assert delta.reasoning is None
        content += delta.content or ""
        for tc in delta.tool_calls:
            assert isinstance(tc, DeltaToolCall)
            if tc.index == len(calls):
                assert tc.id and tc.name and tc.arguments == ""
                calls.append({"id": tc.id, "name": tc.name, "arguments": ""})
            else:
                assert tc.index < len(calls) and tc.id is None and tc.name is None
                calls[tc.index]["arguments"] += tc.arguments
    return calls, content or None


@pytest.mark.parametrize(("parser_name", "text", "expected_calls", "expected_content"), CASES, ids=CASE_IDS)
def test_extract_tool_calls(parser_name, text, expected_calls, expected_content):
    result = TOOL_PARSERS[parser_name]().extract_tool_calls(text)
    assert result.tools_called == bool(expected_calls)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == expected_calls
    assert [c.arguments for c in result.tool_calls] == [json.dumps(a, ensure_ascii=False) for _, a in expected_calls]
    assert result.content == expected_content
    id_format = r"[A-Za-z0-9]{9}" if parser_name == "mistral" else r"call_[0-9a-f]{24}"
    assert all(re.fullmatch(id_format, c.id) for c in result.tool_calls)
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize(("parser_name", "text", "expected_calls", "expected_content"), CASES, ids=CASE_IDS)
def test_stream_reassembles_to_extract_tool_calls(parser_name, text, expected_calls, expected_content, seed):
    whole = TOOL_PARSERS[parser_name]().extract_tool_calls(text)
    calls, content = stream(TOOL_PARSERS[parser_name](), fragments(text, seed))
    assert [c["name"] for c in calls] == [c.name for c in whole.tool_calls]
    assert [c["arguments"] for c in calls] == [c.arguments for c in whole.tool_calls]
    assert [json.loads(c["arguments"]) for c in calls] == [a for _, a in expected_calls]
    assert content == whole.content == expected_content
    id_format = r"[A-Za-z0-9]{9}" if parser_name == "mistral" else r"call_[0-9a-f]{24}"
    assert all(re.fullmatch(id_format, c["id"]) for c in calls)


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
def test_long_plain_text_is_content(parser_name):
    text = "word " * 5000  # CPython's parser runs out of memory on this as an expression: pythonic must not crash
    assert TOOL_PARSERS[parser_name]().extract_tool_calls(text).content == text.strip()
    assert stream(TOOL_PARSERS[parser_name](), fragments(text, 1)) == ([], text.strip())


def test_hermes_call_is_sent_as_name_then_arguments():
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("Checking.\n<tool_call>\n").content == "Checking."
    assert parser.extract_tool_calls_streaming('{"name": "get_weather", "arguments": {"city": "Par') is None
    delta = parser.extract_tool_calls_streaming('is"}}\n</tool_call>')
    assert delta.content is None
    first, args = delta.tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    assert re.fullmatch(r"call_[0-9a-f]{24}", first.id)
    assert args == DeltaToolCall(index=0, arguments='{"city": "Paris"}')
    assert parser.finish_streaming() is None


def test_hermes_marker_split_across_deltas_is_never_content():
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("Sure <tool").content == "Sure"
    assert parser.extract_tool_calls_streaming("_ca") is None
    assert parser.extract_tool_calls_streaming(f"ll>{WEATHER}</tool_call>").tool_calls[0].name == "get_weather"


def test_content_streams_as_it_comes():
    for parser in (HermesToolParser(), MistralToolParser(), Llama3JsonToolParser(), PythonicToolParser()):
        assert parser.extract_tool_calls_streaming("Hello").content == "Hello"
        assert parser.extract_tool_calls_streaming(" world").content == " world"


def test_whitespace_is_held_until_text_follows():
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("Hi\n\n").content == "Hi"
    assert parser.extract_tool_calls_streaming("there").content == "\n\nthere"
    assert parser.extract_tool_calls_streaming("\n") is None
    assert parser.finish_streaming() is None


def test_pythonic_content_streams_once_the_start_rules_out_calls():
    parser = PythonicToolParser()
    assert parser.extract_tool_calls_streaming("[") is None
    assert parser.extract_tool_calls_streaming("1] Smith").content == "[1] Smith"


def test_llama3_unfinished_json_is_content_at_the_end():
    parser = Llama3JsonToolParser()
    assert parser.extract_tool_calls_streaming('<|python_tag|>{"name": "f", "parameters": {') is None
    assert parser.finish_streaming().content == '<|python_tag|>{"name": "f", "parameters": {'


def test_mistral_calls_in_one_array_get_consecutive_indices():
    parser = MistralToolParser()
    delta = parser.extract_tool_calls_streaming(f"[TOOL_CALLS][{WEATHER}, {TIME}]")
    indexed_names = [(tc.index, tc.name) for tc in delta.tool_calls]
    assert indexed_names == [(0, "get_weather"), (0, None), (1, "get_time"), (1, None)]


PIECES = ["<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]", ";",
          '"name": "f", ', '"arguments"', ": ", '{"a": 1}', " ", "\n", "x", "f(", ")", "a=1", "é", "[f(a=1)]",
          '{"name": "g", "arguments": {"b": [1, 2]}}', '{"name": "h", "parameters": {}}', "get_time[ARGS]{}"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.integers(0, 4), st.sampled_from(sorted(TOOL_PARSERS)))
def test_any_text_streams_to_the_same_calls_and_content(pieces, seed, parser_name):
    text = "".join(pieces)
    whole = TOOL_PARSERS[parser_name]().extract_tool_calls(text)
    calls, content = stream(TOOL_PARSERS[parser_name](), fragments(text, seed))
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert content == whole.content
