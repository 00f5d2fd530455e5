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
        self._text = ""  # the streamed text not yet decided
        self._phase = "start"  # start (undecided) -> reasoning -> content, or start -> content
        self._reasoning_started = False
        self._held_newlines = ""
        self._content_newlines_dropped = True  # after </think>: False until the content's leading newlines are gone

    def _start(self, text: str, final: bool) -> tuple[str, int] | None:
        """The phase the output opens in and where it starts, None while undecided."""
        raise NotImplementedError

    def _think_start(self, text: str, final: bool) -> int | None:
        """Where the reasoning starts if `text` opens with `<think>` (else -1), None while that is undecided."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            return len(text) - len(stripped) + len(THINK_START)
        return None if not final and THINK_START.startswith(stripped) else -1

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole response; either is None when empty."""
        parser = type(self)(self.tokenizer)
        parser._text = text
        delta = parser._emit(final=True) or DeltaMessage()
        return delta.reasoning, delta.content

    def extract_reasoning_streaming(self, delta_text: str) -> DeltaMessage | None:
        """Feed the next text delta; returns what to send for it, None when nothing is decided yet."""
        self._text += delta_text
        return self._emit(final=False)

    def finish_streaming(self) -> DeltaMessage | None:
        """At the end of the stream: what was held back (a partial `</think>`, trailing newlines)."""
        return self._emit(final=True)

    def is_reasoning_end(self) -> bool:
        """Whether the streamed text has left the reasoning: structured output applies from here on."""
        return self._phase == "content"

    def _emit(self, final: bool) -> DeltaMessage | None:
        text, pos = self._text, 0
        reasoning = content = ""
        if self._phase == "start":
            opening = self._start(text, final)
            if opening is None:
                return None
            self._phase, pos = opening
        if self._phase == "reasoning":
            end = text.find(THINK_END, pos)
            if end == -1:
                stop = len(text) if final else len(text) - partial_marker_len(text[pos:], THINK_END)
                reasoning, pos = text[pos:stop], stop
            else:
                reasoning, pos = text[pos:end], end + len(THINK_END)
                self._phase, self._content_newlines_dropped = "content", False
            reasoning = self._strip_reasoning(reasoning, final or self._phase == "content")
        if self._phase == "content":
            content, pos = text[pos:], len(text)
            if not self._content_newlines_dropped:
                content = content.lstrip("\n")
                self._content_newlines_dropped = bool(content)
        self._text = text[pos:]  # keep only the undecided text
        if not reasoning and not content:
            return None
        return DeltaMessage(content=content or None, reasoning=reasoning or None)

    def _strip_reasoning(self, reasoning: str, ended: bool) -> str:
        """Leading newlines dropped; trailing newlines held until more reasoning follows (dropped at its end)."""
        if not self._reasoning_started:
            reasoning = reasoning.lstrip("\n")
            self._reasoning_started = bool(reasoning)
        reasoning = self._held_newlines + reasoning
        shown = reasoning.rstrip("\n")
        self._held_newlines = "" if ended else reasoning[len(shown) :]
        return shown


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and Qwen3-Thinking-2507, QwQ): the chat template opens `<think>` in the prompt, so the output is
    reasoning until `</think>` (a `<think>` the model writes itself is dropped); without `</think>`, all reasoning."""

    def _start(self, text, final):
        start = self._think_start(text, final)
        return None if start is None else ("reasoning", max(start, 0))


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the output opens with `<think>` when thinking; without it (enable_thinking=False) it is all content.
    A `<think>` with no `</think>` (generation stopped) is all reasoning."""

    def _start(self, text, final):
        start = self._think_start(text, final)
        if start is None:
            return None
        return ("reasoning", start) if start >= 0 else ("content", 0)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
