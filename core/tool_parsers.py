"""Tool-call parsers: split a model's text into OpenAI tool calls and content, whole or streamed delta by delta.

Every parser describes its format once, as `_parse(text, final)`: the decided part of `text` as a list of content
strings and `(name, arguments_json)` calls. Streaming re-parses the text so far and sends what was decided since the
last delta, so a streamed response reassembles to exactly what `extract_tool_calls` returns for the same text.
A call is sent only once its JSON is complete (first a delta with index, id and name, then its arguments in one
fragment): a call that turns out malformed is never sent, its text is content instead.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
from dataclasses import dataclass, field


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


# NaN and Infinity are not JSON: a call carrying them would be re-encoded into arguments no client can parse.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
# What decoding a model's JSON can raise: ValueError (JSONDecodeError, too many digits), RecursionError (too deep).
_JSON_ERRORS = (ValueError, RecursionError)
_ALNUM = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    """A complete call: `arguments` is a JSON object as a string."""

    name: str
    arguments: str
    id: str


@dataclass
class ExtractedToolCalls:
    """A whole response split into its calls and the text outside them (None when that is only whitespace)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class DeltaToolCall:
    """One streamed piece of a call, as OpenAI sends it: index, id and name first, then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaMessage:
    """What one streamed chunk carries beyond the role."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


Item = str | tuple[str, str]  # content text, or (name, arguments_json)


def make_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (held back while streaming)."""
    if marker[0] not in text[-len(marker) + 1 :]:
        return 0
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _call(obj, arg_keys: tuple[str, ...], args_required: bool = False) -> tuple[str, str] | None:
    """(name, arguments_json) from a decoded `{"name": ..., "arguments": {...}}`, None if it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in arg_keys if k in obj), None)
    if key is None and args_required:
        return None
    args = {} if key is None else obj[key]
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = _DECODER.decode(args)
        except _JSON_ERRORS:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolParser:
    """Base: one instance per request, since it holds the streaming state."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer  # unused: every format here is parsed from text
        self._text = ""  # the streamed text not yet decided
        self._at_start = True  # whether self._text is the start of the output
        self._rest_is_content = False
        self._calls_sent = 0
        self._content_started = False
        self._held_whitespace = ""

    def _parse(self, text: str, final: bool, at_start: bool) -> tuple[list[Item], int | None]:
        """The decided items of `text` in order, and where the undecided rest starts (None: all later text is
        content). With final=False, leave out anything later text could change. `text` is the whole output when
        `at_start`, else what followed the end of an earlier parse."""
        raise NotImplementedError

    def _make_id(self) -> str:
        return make_tool_call_id()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        items, _ = self._parse(text, final=True, at_start=True)
        calls = [ToolCall(name, args, self._make_id()) for name, args in (i for i in items if isinstance(i, tuple))]
        content = "".join(i for i in items if isinstance(i, str)).strip()
        return ExtractedToolCalls(tools_called=bool(calls), tool_calls=calls, content=content or None)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        """Feed the next text delta; returns what to send for it, None when nothing is decided yet."""
        self._text += delta_text
        return self._emit(final=False)

    def finish_streaming(self) -> DeltaMessage | None:
        """At the end of the stream: what was held back (a partial marker, an unfinished call) as content or calls."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> DeltaMessage | None:
        # Only the undecided text is kept and parsed again, so a delta costs its own length, not the response's.
        if self._rest_is_content:
            items: list[Item] = [self._text]
            self._text = ""
        else:
            items, resume = self._parse(self._text, final, self._at_start)
            self._rest_is_content = resume is None
            resume = len(self._text) if resume is None else resume
            if resume:
                self._text, self._at_start = self._text[resume:], False
        deltas = []
        for name, args in (i for i in items if isinstance(i, tuple)):
            index = self._calls_sent
            deltas += [DeltaToolCall(index, self._make_id(), name, ""), DeltaToolCall(index, arguments=args)]
            self._calls_sent += 1
        content = self._strip_content("".join(i for i in items if isinstance(i, str)), final)
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas)

    def _strip_content(self, content: str, final: bool) -> str:
        """The content stripped as extract_tool_calls strips it: leading whitespace dropped, trailing whitespace
        held until text follows it (dropped at the end)."""
        if not self._content_started:
            content = content.lstrip()
            self._content_started = bool(content)
        content = self._held_whitespace + content
        shown = content.rstrip()
        self._held_whitespace = "" if final else content[len(shown) :]
        return shown


class _MarkedToolParser(ToolParser):
    """Formats where each call (or group of calls) follows a start marker; text between them is content."""

    start: str

    def _parse_block(self, text: str, pos: int, final: bool) -> tuple[list[tuple[str, str]] | None, int] | None:
        """The calls after a start marker ending at `pos` (None: not calls, content) and where the block ends;
        None while undecided."""
        raise NotImplementedError

    def _parse(self, text, final, at_start):
        items: list[Item] = []
        pos = 0
        while True:
            start = text.find(self.start, pos)
            if start == -1:
                end = len(text) if final else len(text) - partial_marker_len(text[pos:], self.start)
                items.append(text[pos:end])
                return items, end
            items.append(text[pos:start])
            block = self._parse_block(text, start + len(self.start), final)
            if block is None:
                return items, start
            calls, pos = block
            if calls is None:
                items.append(text[start:pos])
            else:
                items.extend(calls)


class HermesToolParser(_MarkedToolParser):
    """Qwen2.5/Qwen3 and Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or more.

    A last block without `</tool_call>` (generation stopped) still counts when its JSON is complete."""

    start = "<tool_call>"
    end = "</tool_call>"

    def _parse_block(self, text, pos, final):
        end = text.find(self.end, pos)
        if end == -1 and not final:
            return None
        body, block_end = (text[pos:], len(text)) if end == -1 else (text[pos:end], end + len(self.end))
        try:
            call = _call(_DECODER.decode(body), ("arguments", "parameters"))
        except _JSON_ERRORS:
            call = None
        return (None if call is None else [call]), block_end


class MistralToolParser(_MarkedToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or with newer tokenizers (v11+)
    `[TOOL_CALLS]name[ARGS]{...}` per call. Ids are 9 alphanumeric characters, as Mistral's templates require."""

    start = "[TOOL_CALLS]"
    args_marker = "[ARGS]"

    def _make_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def _parse_block(self, text, pos, final):
        pos = _skip_ws(text, pos)
        if pos == len(text):
            return (None, pos) if final else None
        if text[pos] == "[":
            return self._decoded(text, pos, final, lambda arr: [_call(o, ("arguments",)) for o in arr])
        args_at = text.find(self.args_marker, pos)
        if args_at == -1:
            return (None, len(text)) if final else None
        name = text[pos:args_at].strip()
        if not re.fullmatch(r"[\w.\-]+", name):
            return None, args_at
        return self._decoded(text, _skip_ws(text, args_at + len(self.args_marker)), final,
                             lambda args: [_call({"name": name, "arguments": args}, ("arguments",))])

    @staticmethod
    def _decoded(text, pos, final, to_calls):
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except _JSON_ERRORS:
            return (None, len(text)) if final else None
        calls = to_calls(obj)
        return (None if not calls or None in calls else calls), end


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+: the output is (after an optional `<|python_tag|>`) `{"name": ..., "parameters": {...}}`, possibly
    several separated by `;`. Output that does not start so is content; text after the last call is content."""

    python_tag = "<|python_tag|>"

    def _parse(self, text, final, at_start):
        pos = 0  # at the start of the output, or right after a call
        if at_start:
            stripped = text.lstrip()
            if stripped.startswith(self.python_tag):
                pos = len(text) - len(stripped) + len(self.python_tag)
            elif not final and self.python_tag.startswith(stripped):
                return [], 0
        items: list[Item] = []
        content_from = 0
        pos = _skip_ws(text, pos)
        while True:
            if not at_start and pos < len(text) and text[pos] == ";":
                pos = _skip_ws(text, pos + 1)
            if pos == len(text):
                if not final:
                    return items, content_from
                return ([text], None) if at_start else (items, len(text))
            if text[pos] != "{":
                return [*items, text[content_from:]], None
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except _JSON_ERRORS:
                return (items, content_from) if not final else ([*items, text[content_from:]], None)
            call = _call(obj, ("parameters", "arguments"), args_required=True)
            if call is None:
                return [*items, text[content_from:]], None
            items.append(call)
            content_from, at_start = end, False
            pos = _skip_ws(text, end)


def _literal(node: ast.AST):
    """A JSON value from a Python literal: str, int, float, bool, None, list, dict with str keys."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, str | int | float)):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a JSON number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("dict keys must be strings")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    raise ValueError(f"not a literal: {ast.dump(node)}")


def _call_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and _call_name(func.value):
        return f"{_call_name(func.value)}.{func.attr}"
    return None


class PythonicToolParser(ToolParser):
    """Llama 3.2/4 pythonic: the whole output is `[get_weather(city="Paris"), other(x=1)]`, keyword arguments with
    literal values only; anything else is content. Decided when the output ends, unless its start already rules
    out a call list (content then streams as it comes)."""

    _call_start = re.compile(r"[A-Za-z_][\w.]*")

    def _may_be_calls(self, text: str) -> bool:
        stripped = text.lstrip()
        if not stripped:
            return True
        if stripped[0] != "[":
            return False
        rest = stripped[1:].lstrip()
        if not rest:
            return True
        name = self._call_start.match(rest)
        if name is None:
            return False
        after = rest[name.end() :].lstrip()
        return not after or after[0] == "("

    def _parse(self, text, final, at_start):
        # Only the start is ever parsed: once undecided text is decided, it is all calls or all content.
        if not self._may_be_calls(text):
            return [text], None
        if not final:
            return [], 0
        try:
            tree = ast.parse(text.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return [text], None
            calls: list[Item] = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or node.args or _call_name(node.func) is None:
                    return [text], None
                if any(kw.arg is None for kw in node.keywords):  # **kwargs
                    return [text], None
                args = {kw.arg: _literal(kw.value) for kw in node.keywords}
                calls.append((_call_name(node.func), json.dumps(args, ensure_ascii=False)))
            return calls, len(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # MemoryError: too deeply nested for CPython
            return [text], None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}
