"""`vserve bench startup`: how long `vserve serve` takes from process start to `/health` 200 (or `vserve generate`
to its first streamed token), with an empty and a warm Triton cache, and where the time went (as `vllm bench
startup`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from vserve.cli.engine_args import engine_argv

console = Console(highlight=False)
MODES = ("serve", "generate")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _fail(proc: subprocess.Popen, log: Path, what: str) -> ValueError:
    proc.kill()
    proc.wait()
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return ValueError(f"{what} (exit code {proc.returncode}): {' | '.join(tail)}")


def time_serve(argv: list[str], env: dict, log: Path, timeout_s: float) -> float:
    """Seconds from starting `vserve serve` to its first `/health` 200; the server is stopped after."""
    port = _free_port()
    cmd = [sys.executable, "-m", "vserve.cli.main", "serve", *argv, "--port", str(port),
           "--disable-uvicorn-access-log"]
    with log.open("w") as out:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while not _healthy(f"http://127.0.0.1:{port}/health"):
                if proc.poll() is not None:
                    raise _fail(proc, log, "vserve serve exited before it was healthy")
                if time.monotonic() - start > timeout_s:
                    raise _fail(proc, log, f"vserve serve was not healthy after {timeout_s:.0f} s")
                time.sleep(0.02)
            return time.monotonic() - start
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM (a server drains, then exits), SIGKILL if it has not after timeout_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def time_generate(argv: list[str], env: dict, log: Path, timeout_s: float) -> float:
    """Seconds from starting `vserve generate PROMPT` (streamed) to the first byte of its output."""
    cmd = [sys.executable, "-m", "vserve.cli.main", "generate", "The capital of France is", "--max-tokens", "4",
           "--stream", *argv]
    with log.open("w") as err:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
        first = proc.stdout.read(1)
        seconds = time.monotonic() - start
        proc.stdout.read()
        if proc.wait(timeout_s) != 0 or not first:
            raise _fail(proc, log, "vserve generate failed")
    return seconds


def _read_report(path: Path) -> dict:
    for _ in range(200):  # written as the server starts listening: at most a few ms after /health answers
        if path.exists() and path.stat().st_size:
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass
        time.sleep(0.01)
    return {}


def run_startup(mode: str, argv: list[str], num_cold: int, num_warm: int, timeout_s: float = 600.0) -> list[dict]:
    """One row per start: cache (cold | warm), seconds measured here, and the process's own report."""
    runs: list[dict] = []
    timer = time_serve if mode == "serve" else time_generate
    with tempfile.TemporaryDirectory(prefix="vserve-bench-startup-") as tmp:
        tmp_path = Path(tmp)
        warm_cache: str | None = None
        plan = ["cold"] * num_cold + ["warm"] * num_warm
        if num_warm and not num_cold:
            plan.insert(0, "warm-up")  # fills the Triton cache the warm runs use; not reported
        for i, kind in enumerate(plan):
            cache = tempfile.mkdtemp(dir=tmp, prefix="triton-") if kind == "cold" or warm_cache is None \
                else warm_cache
            warm_cache = cache
            report = tmp_path / f"report-{i}.json"
            env = {**os.environ, "TRITON_CACHE_DIR": cache, "VSERVE_STARTUP_FILE": str(report),
                   "VSERVE_NO_PROGRESS": "1"}
            seconds = timer(argv, env, tmp_path / f"log-{i}.txt", timeout_s)
            if kind != "warm-up":
                runs.append({"cache": kind, "seconds": seconds, "report": _read_report(report)})
    return runs


def _phase_names(runs: list[dict]) -> list[str]:
    names: list[str] = []
    for r in runs:
        for scope in (r["report"], r["report"].get("engine_process") or {}):
            names += [n for n in scope.get("phases", {}) if n not in names]
    return names


def render(mode: str, runs: list[dict]) -> None:
    what = "process start -> /health 200" if mode == "serve" else "process start -> first token"
    table = Table(title=f"vserve {mode} start-up ({what}), seconds", title_justify="left")
    names = _phase_names(runs)
    for col in ("Triton cache", "total", *names, "other"):
        table.add_column(col, justify="right")
    for r in runs:
        api, child = r["report"].get("phases", {}), (r["report"].get("engine_process") or {}).get("phases", {})
        cells = []
        for n in names:
            parts = [f"{api[n]:.2f}" if n in api else "", f"engine {child[n]:.2f}" if n in child else ""]
            cells.append(" / ".join(p for p in parts if p))
        other = r["report"].get("ready_s", 0.0) - sum(api.values())
        table.add_row(r["cache"], f"{r['seconds']:.2f}", *cells, f"{other:.2f}" if api else "")
    console.print(table)
    console.print("Phases as each process timed them (`engine ...`: inside the engine process, which starts "
                  "during `engine process`); `imports` counts from the process's start to the command's body; "
                  "`other`: the rest of the time to ready in the command's own process.")


def startup(
    mode: str = typer.Option("serve", help="serve: process start -> /health 200; generate: process start -> the "
                             "first streamed token"),
    num_iters_cold: int = typer.Option(1, help="Starts with an empty Triton cache (each its own)"),
    num_iters_warm: int = typer.Option(2, help="Starts with the Triton cache a previous start filled"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table"),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Time `vserve serve` (or `vserve generate`) from process start, cold and warm, with a breakdown by phase
    (imports, resolve model, tokenizer, weights, memory profile, KV cache, CUDA graphs, engine process, server)."""
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if num_iters_cold < 0 or num_iters_warm < 0 or num_iters_cold + num_iters_warm == 0:
        raise ValueError("--num-iters-cold and --num-iters-warm must be >= 0 and not both 0")
    runs = run_startup(mode, engine_argv(engine_args), num_iters_cold, num_iters_warm)
    if json_out:
        typer.echo(json.dumps({"mode": mode, "runs": runs}))
    else:
        render(mode, runs)
