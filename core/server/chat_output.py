"""A chat choice's text as the OpenAI message: reasoning split off (--reasoning-parser), tool calls parsed (forced by
tool_choice, or found by --tool-call-parser under "auto"), for the final message and as streamed deltas."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from vserve.core.server.protocol import ChatCompletionRequest, NamedToolChoice


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(name: str, arguments: str, cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def _required_calls(text: str) -> list[dict[str, Any]] | None:
    """tool_choice "required": the grammar made the output a JSON array of {name, parameters}; None if it was cut
    short (finish_reason length) and does not parse."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [_tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False), call_id()) for c in calls]


@dataclass
class ChatOutputParser:
    """One choice's parsing state. `mode`: "named" (the whole output is the named tool's arguments), "required"
    (an array of calls), "auto" (the tool-call parser decides), or None (plain content)."""

    mode: str | None = None
    named: str | None = None
    tool_parser: Any = None
    reasoning_parser: Any = None
    _text: list[str] = field(default_factory=list)
    _named_started: bool = False
    _calls_sent: int = 0

    @classmethod
    def for_request(cls, body: ChatCompletionRequest, settings, tokenizer) -> ChatOutputParser:
        choice = body.effective_tool_choice()
        mode = named = tool_parser = None
        if isinstance(choice, NamedToolChoice):
            mode, named = "named", choice.function.name
        elif choice == "required":
            mode = "required"
        elif choice == "auto" and body.tools:
            if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
                raise ValueError('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                                 "--tool-call-parser (or send tool_choice \"required\", \"none\" or a named tool)")
            from vserve.core.tool_parsers import TOOL_PARSERS

            mode, tool_parser = "auto", TOOL_PARSERS[settings.tool_call_parser](tokenizer)
        reasoning = None
        if settings.reasoning_parser:
            from vserve.core.reasoning_parsers import REASONING_PARSERS

            reasoning = REASONING_PARSERS[settings.reasoning_parser](tokenizer)
        return cls(mode, named, tool_parser, reasoning)

    # ---- the final message --------------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        msg: dict[str, Any] = {"role": "assistant"}
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.extract_reasoning(text)
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
            text = text or ""
        calls = None
        if self.mode == "named":
            calls = [_tool_call(self.named, text, call_id())]
        elif self.mode == "required":
            calls = _required_calls(text)
            if calls is not None:
                finish_reason = "tool_calls"
        elif self.mode == "auto":
            found = self.tool_parser.extract_tool_calls(text)
            if found.tools_called:
                calls = [_tool_call(c.name, c.arguments, c.id) for c in found.tool_calls]
                text, finish_reason = found.content, "tool_calls"
        if calls is None:
            msg["content"] = text
        else:
            msg["content"] = text if self.mode == "auto" else None
            msg["tool_calls"] = calls
        return msg, finish_reason

    # ---- streaming ------------------------------------------------------------------------------------------
    def deltas(self, text: str) -> list[dict[str, Any]]:
        """The delta objects for this piece of text (possibly none yet)."""
        out: list[dict[str, Any]] = []
        if self.reasoning_parser is not None:
            d = self.reasoning_parser.extract_reasoning_streaming(text)
            if d is None:
                return out
            if d.reasoning:
                out.append({"reasoning": d.reasoning, "reasoning_content": d.reasoning})
            text = d.content or ""
        if text:
            out += self._content_deltas(text)
        return out

    def _content_deltas(self, text: str) -> list[dict[str, Any]]:
        if self.mode is None:
            return [{"content": text}]
        if self.mode == "named":
            first = []
            if not self._named_started:
                self._named_started = True
                first = [{"tool_calls": [{"index": 0, **_tool_call(self.named, "", call_id())}]}]
            return first + [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if self.mode == "required":
            self._text.append(text)  # sent once the array is complete (finish)
            return []
        d = self.tool_parser.extract_tool_calls_streaming(text)
        return self._from_delta_message(d)

    def _from_delta_message(self, d) -> list[dict[str, Any]]:
        if d is None:
            return []
        out = []
        if d.content:
            out.append({"content": d.content})
        for c in d.tool_calls:
            item: dict[str, Any] = {"index": c.index}
            fn = {}
            if c.id is not None:
                item["id"], item["type"] = c.id, "function"
            if c.name is not None:
                fn["name"] = c.name
            if c.arguments is not None:
                fn["arguments"] = c.arguments
            item["function"] = fn
            self._calls_sent = max(self._calls_sent, c.index + 1)
            out.append({"tool_calls": [item]})
        return out

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """What is still held back at the end of the stream, and the finish reason to send."""
        out: list[dict[str, Any]] = []
        if self.reasoning_parser is not None:
            d = self.reasoning_parser.finish_streaming()
            if d is not None:
                if d.reasoning:
                    out.append({"reasoning": d.reasoning, "reasoning_content": d.reasoning})
                if d.content:
                    out += self._content_deltas(d.content)
        if self.mode == "required":
            calls = _required_calls("".join(self._text))
            if calls is None:
                out.append({"content": "".join(self._text)})
            else:
                finish_reason = "tool_calls"
                for i, c in enumerate(calls):  # the name first, then the arguments, as OpenAI streams them
                    out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                                "function": {"name": c["function"]["name"], "arguments": ""}}]})
                    out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
        elif self.mode == "auto":
            out += self._from_delta_message(self.tool_parser.finish_streaming())
            if self._calls_sent:
                finish_reason = "tool_calls"
        return out, finish_reason
