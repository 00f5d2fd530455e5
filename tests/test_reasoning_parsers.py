"""Reasoning parsers on outputs written from DeepSeek-R1's and Qwen3's documented formats: whole and streamed in random
fragments, a stream reassembled equals the whole-text split."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vserve.core.reasoning_parsers import REASONING_PARSERS, DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from vserve.core.tool_parsers import HermesToolParser

# (parser, model output, expected reasoning, expected content)
CASES = [
    # deepseek_r1: <think> is in the prompt, the output is reasoning until </think>
    ("deepseek_r1", "Two plus two is four.\n</think>\n\nThe answer is 4.", "Two plus two is four.", "The answer is 4."),
    ("deepseek_r1", "<think>\nTwo plus two is four.\n</think>\n\nThe answer is 4.", "Two plus two is four.",
     "The answer is 4."),
    ("deepseek_r1", "Still working on it: 2 + 2", "Still working on it: 2 + 2", None),
    ("deepseek_r1", "</think>\n\nJust the answer.", None, "Just the answer."),
    ("deepseek_r1", "<think>\n\n</think>\n\nAnswer.", None, "Answer."),
    ("deepseek_r1", "Done thinking.</think>", "Done thinking.", None),
    ("deepseek_r1", "x < y, and </thinking> is no marker\n</think>Ok", "x < y, and </thinking> is no marker", "Ok"),
    ("deepseek_r1", "Reasoning ends with </thi", "Reasoning ends with </thi", None),
    ("deepseek_r1", "Über 天気 ☀️\n</think>\n\nRésumé: 晴れ", "Über 天気 ☀️", "Résumé: 晴れ"),
    # qwen3: <think>...</think> opens the output; no <think> means thinking is off
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", "The user greets me.",
     "Hello! How can I help?"),
    ("qwen3", "Hello! How can I help?", None, "Hello! How can I help?"),
    ("qwen3", "<think>\nStill thinking", "Still thinking", None),
    ("qwen3", "\n<think>\nA\n\nB\n</think>\n\nC\n", "A\n\nB", "C\n"),
    ("qwen3", "Use <think> tags to reason.", None, "Use <think> tags to reason."),
    ("qwen3", "<thought>not a marker</thought>", None, "<thought>not a marker</thought>"),
    ("qwen3", "<think>\nUnicode: 天気 ☀️\n</think>\n\n晴れです。", "Unicode: 天気 ☀️", "晴れです。"),
    ("qwen3", "", None, None),
]
CASE_IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]


def fragments(text: str, seed: int) -> list[str]:
    """`text` cut at random places; seed 0 cuts after every character."""
    rng = random.Random(seed)
    pieces, pos = [], 0
    while pos < len(text):
        size = 1 if seed == 0 else rng.randint(1, 8)
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


@pytest.mark.parametrize(("parser_name", "text", "reasoning", "content"), CASES, ids=CASE_IDS)
def test_extract_reasoning(parser_name, text, reasoning, content):
    assert REASONING_PARSERS[parser_name]().extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize(("parser_name", "text", "reasoning", "content"), CASES, ids=CASE_IDS)
def test_stream_reassembles_to_extract_reasoning(parser_name, text, reasoning, content, seed):
    parser = REASONING_PARSERS[parser_name]()
    got_reasoning, got_content = "", ""
    for delta in [parser.extract_reasoning_streaming(p) for p in fragments(text, seed)] + [parser.finish_streaming()]:
        if delta is not None:
            assert delta.reasoning or delta.content, "an empty delta is sent as None"
            assert not delta.tool_calls
            got_reasoning += delta.reasoning or ""
            got_content += delta.content or ""
    assert (got_reasoning or None, got_content or None) == (reasoning, content)


def test_split_end_marker_is_held_back():
    parser = DeepSeekR1ReasoningParser()
    assert parser.extract_reasoning_streaming("I think</th").reasoning == "I think"
    assert not parser.is_reasoning_end()
    delta = parser.extract_reasoning_streaming("ink>\n\nFour")
    assert (delta.reasoning, delta.content) == (None, "Four")
    assert parser.is_reasoning_end()
    assert parser.finish_streaming() is None


def test_trailing_newlines_of_reasoning_wait_for_more_reasoning():
    parser = DeepSeekR1ReasoningParser()
    assert parser.extract_reasoning_streaming("a\n").reasoning == "a"
    assert parser.extract_reasoning_streaming("b").reasoning == "\nb"
    assert parser.extract_reasoning_streaming("\n</think>") is None
    assert parser.is_reasoning_end()


def test_qwen3_without_think_is_content_and_past_reasoning():
    parser = Qwen3ReasoningParser()
    assert parser.extract_reasoning_streaming("<th") is None
    assert not parser.is_reasoning_end()
    assert parser.extract_reasoning_streaming("is is plain").content == "<this is plain"
    assert parser.is_reasoning_end()


def test_qwen3_reasoning_then_hermes_tool_call():
    """How the chat route chains them: the reasoning parser's content deltas feed the tool parser."""
    text = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    reasoning_parser, tool_parser = Qwen3ReasoningParser(), HermesToolParser()
    reasoning, calls = "", []
    for piece in [*fragments(text, 5), None]:
        delta = reasoning_parser.finish_streaming() if piece is None else reasoning_parser.extract_reasoning_streaming(
            piece)
        if delta is None:
            continue
        reasoning += delta.reasoning or ""
        if delta.content:
            tool_delta = tool_parser.extract_tool_calls_streaming(delta.content)
            calls += tool_delta.tool_calls if tool_delta else []
    tool_delta = tool_parser.finish_streaming()
    calls += tool_delta.tool_calls if tool_delta else []
    assert reasoning == "The user wants the weather."
    assert [(c.index, c.name) for c in calls] == [(0, "get_weather"), (0, None)]
    assert json.loads(calls[1].arguments) == {"city": "Paris"}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "</th", "<th", "\n", " ", "a", "é", "<"]), max_size=12),
       st.integers(0, 3), st.sampled_from(sorted(REASONING_PARSERS)))
def test_any_text_streams_to_the_same_split(pieces, seed, parser_name):
    text = "".join(pieces)
    parser = REASONING_PARSERS[parser_name]()
    reasoning, content = "", ""
    for delta in [parser.extract_reasoning_streaming(p) for p in fragments(text, seed)] + [parser.finish_streaming()]:
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    assert (reasoning or None, content or None) == REASONING_PARSERS[parser_name]().extract_reasoning(text)
