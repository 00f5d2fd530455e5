"""Rich progress bars for long work (loading, converting, generating)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")
console = Console(stderr=True)


def enabled() -> bool:
    return os.environ.get("VSERVE_NO_PROGRESS", "") in ("", "0") and sys.stderr is not None


def make_progress(*extra_columns) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    *extra_columns, TimeElapsedColumn(), console=console, transient=False,
                    disable=not enabled())


def progress_bar(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    with make_progress() as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)
