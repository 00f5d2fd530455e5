"""How every kernel microbenchmark here times a call: warm-up, then CUDA events around replays of a CUDA graph of
the calls (as the engine replays decode steps: no Python launch cost in the number), the median of several repeats.

Cold L2: a decode step finds each layer's weights in HBM, not in L2 (60 MB on an H200), while a call timed over and
over keeps its weight in L2. `copies(make, nbytes)` makes enough copies of a call's inputs that one pass through them
reads at least COLD_BYTES, and `time_ms(fn, inputs=those copies)` times one pass and divides by their number.
On the CPU (the --cpu-smoke runs, kernels under TRITON_INTERPRET=1) the calls are timed with time.perf_counter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

COLD_BYTES = 256 << 20  # > 4x an H200's L2


def copies(make: Callable[[], tuple], nbytes: int, cold_bytes: int = COLD_BYTES) -> list[tuple]:
    """make()'s inputs once (cold_bytes 0: a hot L2), or as many times as it takes to read cold_bytes at nbytes
    each."""
    return [make() for _ in range(max(1, -(-cold_bytes // max(nbytes, 1))))]


def time_ms(fn: Callable[..., object], device: str | torch.device, inputs: Sequence[tuple] = ((),), *,
            iters: int = 20, repeats: int = 5, warmup: int = 3, graph: bool = True) -> float:
    """Median ms per call of fn(*args) for args in inputs: each repeat times `iters` passes over inputs (one CUDA
    graph of them where it captures, else eager launches), after `warmup` passes (compiles, autotuning)."""
    def one_pass() -> None:
        for args in inputs:
            fn(*args)

    calls = iters * len(inputs)
    if torch.device(device).type != "cuda":
        for _ in range(min(warmup, 1)):
            one_pass()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                one_pass()
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
        return statistics.median(samples)
    for _ in range(warmup):
        one_pass()
    torch.cuda.synchronize()

    def eager() -> None:
        for _ in range(iters):
            one_pass()

    run = eager
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                eager()
            run = g.replay
        except Exception:  # not capturable (a host sync inside): launch it eagerly
            torch.cuda.synchronize()
    run()  # a graph's first replay uploads it
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def smoke_iters(cpu_smoke: bool) -> dict:
    """time_ms's keywords for a --cpu-smoke run: one call of each, untimed but for the check that it runs."""
    return dict(iters=1, repeats=1, warmup=0) if cpu_smoke else {}


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None, cpu_help: str) -> argparse.Namespace | None:
    """ap's arguments plus --out and --cpu-smoke (cpu_help): under --cpu-smoke the kernels run interpreted on one
    thread (TRITON_INTERPRET set before triton is imported); without it, None (and a message) where no GPU is."""
    ap.add_argument("--out", default=".")
    ap.add_argument("--cpu-smoke", action="store_true", help=cpu_help)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print(f"{os.path.basename(sys.argv[0])} needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return None
    return args
