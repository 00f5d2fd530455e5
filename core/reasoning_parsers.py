"""Reasoning parsers: split `<think>...</think>` off a model's text into the message's `reasoning`, whole or streamed.

As in the Qwen3 chat template's own split, the newlines around the reasoning and those right after `</think>` are
dropped (vLLM keeps them). Streaming re-splits the text so far and sends what was decided since the last delta,
holding back a possible start of `</think>` and trailing newlines of the reasoning, so a stream reassembles to
exactly what `extract_reasoning` returns.
"""

from __future__ import annotations

from vserve.core.tool_parsers import DeltaMessage, partial_marker_len

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """Base: one instance per request, since it holds the streaming state."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer  # unused: the markers are found in text
        self._text = ""
        self._reasoning_sent = 0
        self._content_sent = 0
        self._reasoning_ended = False

    def _split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(reasoning, content) decided so far, markers removed; content is None until the reasoning has ended."""
        raise NotImplementedError

    def _split_think(self, text: str, final: bool) -> tuple[str, str | None]:
        """Reasoning up to `</think>` (without it: all of `text`), a leading `<think>` removed."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            text = stripped[len(THINK_START) :]
        elif not final and THINK_START.startswith(stripped):
            return "", None
        end = text.find(THINK_END)
        if end == -1:
            reasoning = text if final else text[: len(text) - partial_marker_len(text, THINK_END)]
            return reasoning.strip("\n"), None
        return text[:end].strip("\n"), text[end + len(THINK_END) :].lstrip("\n")

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole response; either is None when empty."""
        reasoning, content = self._split(text, final=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(self, delta_text: str) -> DeltaMessage | None:
        """Feed the next text delta; returns what to send for it, None when nothing is decided yet."""
        self._text += delta_text
        return self._emit(final=False)

    def finish_streaming(self) -> DeltaMessage | None:
        """At the end of the stream: what was held back (a partial `</think>`, trailing newlines)."""
        return self._emit(final=True)

    def is_reasoning_end(self) -> bool:
        """Whether the streamed text has left the reasoning: structured output applies from here on."""
        return self._reasoning_ended

    def _emit(self, final: bool) -> DeltaMessage | None:
        reasoning, content = self._split(self._text, final)
        self._reasoning_ended = content is not None
        content = content or ""
        new_reasoning, new_content = reasoning[self._reasoning_sent :], content[self._content_sent :]
        self._reasoning_sent, self._content_sent = len(reasoning), len(content)
        if not new_reasoning and not new_content:
            return None
        return DeltaMessage(content=new_content or None, reasoning=new_reasoning or None)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and Qwen3-Thinking-2507, QwQ): the chat template opens `<think>` in the prompt, so the output is
    reasoning until `</think>` (a `<think>` the model writes itself is dropped); without `</think>`, all reasoning."""

    def _split(self, text, final):
        return self._split_think(text, final)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the output opens with `<think>` when thinking; without it (enable_thinking=False) it is all content.
    A `<think>` with no `</think>` (generation stopped) is all reasoning."""

    def _split(self, text, final):
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            return self._split_think(text, final)
        if not final and THINK_START.startswith(stripped):
            return "", None
        return "", text


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
