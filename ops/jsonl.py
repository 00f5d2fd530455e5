"""JSON Lines input files (prompts, calibration text): one object per non-blank line, errors with line numbers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def jsonl_objects(path: Path, lines: list[str]) -> Iterator[tuple[int, object]]:
    """(line number, decoded object) for each non-blank line; ValueError naming the line for invalid JSON."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
