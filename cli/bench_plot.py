"""PNG charts for `bench serve` (matplotlib, Agg backend): latency CDFs, tok/s over time, sweep curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from vserve.cli.bench_metrics import RequestFuncOutput, output_throughput_over_time  # noqa: E402

CDF_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL"))


def _label(run: dict[str, Any]) -> str:
    return f"concurrency {run['max_concurrency'] or 'inf'}"


def _values_ms(outputs: list[RequestFuncOutput], metric: str) -> list[float]:
    ok = [o for o in outputs if o.success]
    if metric == "ttft":
        return sorted(o.ttft * 1000 for o in ok)
    if metric == "tpot":
        return sorted(o.tpot * 1000 for o in ok if o.tpot is not None)
    return sorted(o.latency * 1000 for o in ok)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_latency_cdfs(path: Path, runs: list[dict[str, Any]], per_request: list[list[RequestFuncOutput]]) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (metric, name) in zip(axes, CDF_METRICS):
        for run, outputs in zip(runs, per_request):
            v = _values_ms(outputs, metric)
            if v:
                ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=_label(run))
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Latency distributions (successful requests)")
    return _save(fig, path)


def plot_throughput_over_time(path: Path, runs: list[dict[str, Any]],
                              per_request: list[list[RequestFuncOutput]]) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run, outputs in zip(runs, per_request):
        bin_s = max(run["duration_s"] / 50, 0.05)
        points = output_throughput_over_time(outputs, bin_s)
        if points:
            ax.plot([t for t, _ in points], [r for _, r in points], drawstyle="steps-post", label=_label(run))
    ax.set_title("Output throughput over time")
    ax.set_xlabel("time since benchmark start (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_sweep(path: Path, runs: list[dict[str, Any]]) -> Path:
    levels = [r["max_concurrency"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(levels, [r["output_throughput"] for r in runs], marker="o", label="output")
    left.plot(levels, [r["total_token_throughput"] for r in runs], marker="o", label="total (prompt + output)")
    left.set_title("Throughput vs concurrency")
    left.set_ylabel("tokens/s")
    for metric, name in CDF_METRICS:
        right.plot(levels, [r[f"p99_{metric}_ms"] for r in runs], marker="o", label=f"p99 {name}")
    right.set_title("p99 latency vs concurrency")
    right.set_ylabel("latency (ms)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("max concurrency (requests in flight)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_serve(folder: Path, runs: list[dict[str, Any]], per_request: list[list[RequestFuncOutput]]) -> list[Path]:
    """latency_cdf.png and throughput_over_time.png; sweep.png too when runs cover several finite levels."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency_cdfs(folder / "latency_cdf.png", runs, per_request),
             plot_throughput_over_time(folder / "throughput_over_time.png", runs, per_request)]
    if len(runs) > 1 and all(r["max_concurrency"] for r in runs):
        paths.append(plot_sweep(folder / "sweep.png", runs))
    return paths
