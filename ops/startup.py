"""Start-up phases: how long each part of bringing an engine up took in this process, and when it was ready,
counted from the process's start; `vserve bench startup` reads them from the file VSERVE_STARTUP_FILE names."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

_IMPORTED = time.monotonic()
PHASES: dict[str, float] = {}  # phase -> seconds, in the order they ran
CHILD: dict[str, object] = {}  # the engine process's own report, when it runs in one


def process_age() -> float:
    """Seconds since this process started (Linux: its start time in /proc; elsewhere since this module was
    imported, which misses the interpreter's own start)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time after boot, in clock ticks
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


def mark_imports() -> None:
    """The command's body starts: everything before it (interpreter, imports, argument parsing) is `imports`."""
    PHASES.setdefault("imports", process_age())


@contextmanager
def phase(name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - start


def report() -> dict:
    """{"ready_s": seconds from process start to now, "phases": {...}, "engine_process": the child's report}."""
    out: dict[str, object] = {"ready_s": process_age(), "phases": dict(PHASES)}
    if CHILD:
        out["engine_process"] = dict(CHILD)
    return out


def write_report() -> None:
    """The report into $VSERVE_STARTUP_FILE, when it is set (by `vserve bench startup`)."""
    path = os.environ.get("VSERVE_STARTUP_FILE")
    if path:
        with open(path, "w") as f:
            json.dump(report(), f)
