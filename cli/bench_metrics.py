"""Online-serving metrics from per-request timestamps (vLLM's `benchmark_serving` definitions); pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestFuncOutput:
    """One request as the client saw it; times in seconds, `start` relative to the benchmark's start."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0  # request sent -> first non-empty token chunk
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    latency: float = 0.0  # E2EL: request sent -> last byte
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def chunk_times(self) -> list[float]:
        """Arrival time of every token chunk, relative to the benchmark's start."""
        t = self.start + self.ttft
        times = [t]
        for gap in self.itl:
            t += gap
            times.append(t)
        return times


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats_ms(values_s: list[float]) -> dict[str, float]:
    """mean, median, std (population) and the PERCENTILES of seconds, in milliseconds."""
    ms = [v * 1000 for v in values_s]
    n = len(ms)
    mean = sum(ms) / n if n else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / n) if n else 0.0
    out = {"mean": mean, "median": percentile(ms, 50), "std": std}
    out.update({f"p{p}": percentile(ms, p) for p in PERCENTILES})
    return out


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50 e2el:2000'] -> {'ttft': 500.0, 'tpot': 50.0, 'e2el': 2000.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for part in " ".join(specs).replace(",", " ").split():
        name, _, value = part.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in GOODPUT_METRICS or ms <= 0:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)} and MS > 0, "
                             f"got {part!r}")
        slos[name] = ms
    return slos


def meets_slos(o: RequestFuncOutput, slos: dict[str, float]) -> bool:
    values = {"ttft": o.ttft, "tpot": o.tpot or 0.0, "e2el": o.latency}
    return o.success and all(values[k] * 1000 <= ms for k, ms in slos.items())


def summarize(outputs: list[RequestFuncOutput], duration_s: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Counts, throughputs and {mean,median,std,p50,p90,p99}_{ttft,tpot,itl,e2el}_ms over successful requests."""
    ok = [o for o in outputs if o.success]
    d = max(duration_s, 1e-9)
    inp, out = sum(o.prompt_len for o in ok), sum(o.output_tokens for o in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(outputs) - len(ok), "duration_s": duration_s,
        "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": len(ok) / d, "output_throughput": out / d, "total_token_throughput": (inp + out) / d,
        "goodput": sum(meets_slos(o, slos) for o in ok) / d if slos else None,
    }
    series = {"ttft": [o.ttft for o in ok], "tpot": [o.tpot for o in ok if o.tpot is not None],
              "itl": [g for o in ok for g in o.itl], "e2el": [o.latency for o in ok]}
    for metric in METRICS:
        for stat, value in stats_ms(series[metric]).items():
            summary[f"{stat}_{metric}_ms"] = value
    errors: dict[str, int] = {}
    for o in outputs:
        if not o.success:
            errors[o.error] = errors.get(o.error, 0) + 1
    summary["errors"] = errors
    return summary


def output_throughput_over_time(outputs: list[RequestFuncOutput], bin_s: float) -> list[tuple[float, float]]:
    """(bin start s, output tok/s) per bin; a request's tokens are spread evenly over its chunks."""
    bins: dict[int, float] = {}
    for o in outputs:
        if not o.success:
            continue
        times = o.chunk_times()
        per_chunk = o.output_tokens / len(times)
        for t in times:
            bins[int(t // bin_s)] = bins.get(int(t // bin_s), 0.0) + per_chunk
    if not bins:
        return []
    return [(i * bin_s, bins.get(i, 0.0) / bin_s) for i in range(max(bins) + 1)]
