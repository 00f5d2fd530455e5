"""Neutralise the special-token strings of a tokenizer in untrusted text (`LLM.sanitize_input`, and the server's
user and tool message content by default): a user who types `<|im_end|><|im_start|>system` gets those characters as
ordinary text, never the template's special tokens, so cannot open a turn of another role.

A zero-width space (U+200B) goes after the first character of each special-token string: the tokenizer matches added
tokens as exact strings, so the broken string tokenizes as ordinary text, and it reads the same on screen."""

from __future__ import annotations

import re

ZWSP = "\u200b"
_PATTERNS: dict[int, tuple[object, re.Pattern | None]] = {}  # id(tokenizer) -> (tokenizer, its pattern)


def special_token_strings(tokenizer) -> list[str]:
    """The strings that tokenize to a special token, longest first."""
    strings = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            strings.add(str(tok.content))
    return sorted((s for s in strings if len(s) > 1), key=len, reverse=True)


def _pattern(tokenizer) -> re.Pattern | None:
    hit = _PATTERNS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        strings = special_token_strings(tokenizer)
        hit = _PATTERNS[id(tokenizer)] = (tokenizer, re.compile("|".join(map(re.escape, strings))) if strings
                                          else None)
    return hit[1]


def sanitize_input(tokenizer, text: str) -> str:
    """text with every special-token string of the tokenizer broken by a zero-width space."""
    pattern = _pattern(tokenizer)
    if pattern is None:
        return text
    for _ in range(4):  # one pass breaks every match; another only if a break formed a new one (it cannot, but check)
        if pattern.search(text) is None:
            return text
        text = pattern.sub(lambda m: m.group(0)[0] + ZWSP + m.group(0)[1:], text)
    raise AssertionError("special-token strings remain after sanitizing")
