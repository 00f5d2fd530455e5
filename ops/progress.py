"""Rich progress bars for long work (loading, converting, generating)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

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


@contextmanager
def phase_progress(description: str, num_items: int, phases: tuple[str, ...],
                   item: str = "layer") -> Iterator[Callable[[int, str], None]]:
    """A bar over num_items x len(phases) steps with the time left (rich's estimate from the steps done so far), so
    the estimate moves within an item; yields done(i, phase): phase of item i (0-based) is finished."""
    columns = (TextColumn("[bold]{task.description}"), BarColumn(),
               TextColumn(f"{item} {{task.fields[item]}}/{num_items} {{task.fields[phase]}}"), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False, disable=not enabled()) as progress:
        task = progress.add_task(description, total=num_items * len(phases), item=1, phase=phases[0])

        def done(i: int, phase: str) -> None:
            k = phases.index(phase) + 1  # the phase shown next
            if k == len(phases):
                i, k = i + 1, 0
            progress.update(task, advance=1, item=min(i + 1, num_items),
                            phase="done" if i == num_items else phases[k])

        yield done
