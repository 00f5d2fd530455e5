"""Summarize sitecustomize.py's traces: per process, the largest run of steps (the benchmark's timed run), or with
--all-runs every run of 50 steps or more (a process that ran its engine twice: `bench throughput --json-schema` runs
the same lengths unconstrained after the constrained run).

    python benchmarks/steptrace/analyze.py DIR [--json] [--all-runs]
"""

import json
import statistics
import sys
from pathlib import Path


def runs(events: list[dict]) -> list[list[dict]]:
    """Steps split where the engine went idle (nothing running or waiting after a step)."""
    out, cur = [], []
    for e in events:
        if e["k"] != "step":
            continue
        cur.append(e)
        if e["running"] == 0 and e["waiting"] == 0:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def summarize(events: list[dict], recvs: list[dict], i: int | None = None) -> dict | None:
    """Run i's numbers (None: the largest run's); `recvs`: the server process's reader events (engine-process
    mode)."""
    all_runs = runs(events)
    if not all_runs:
        return None
    if i is None:
        i = max(range(len(all_runs)), key=lambda j: sum(s["tokens"] for s in all_runs[j]))
    steps = all_runs[i]
    t_start, t_end = steps[0]["t0"], steps[-1]["t1"]
    t_prev = all_runs[i - 1][-1]["t1"] if i else float("-inf")
    adds = [e["t"] for e in events if e["k"] == "add" and t_prev < e["t"] <= t_end]
    # Each emitted message is read once, in order: pair them over the whole trace, then keep this run's pairs.
    # (emit_to_apply runs from the engine's send() returning, so the reader may already have started: a small
    # negative mean is possible on a busy machine.)
    all_emits = [e for e in events if e["k"] == "emit"]
    pairs = [(e, r) for e, r in zip(all_emits, sorted(recvs, key=lambda r: r["t0"]))
             if t_start <= e["t0"] <= t_end + 1] if len(all_emits) == len(recvs) else []
    emits = [e for e in all_emits if t_start <= e["t0"] <= t_end + 1]
    recv = [e for e in recvs if t_start <= e["t0"] <= t_end + 1]
    peak = max(s["running"] for s in steps)
    decode = [s for s in steps if s["tokens"] == s["running"] and s["running"] >= 0.9 * peak]
    prefill = [s for s in steps if s["tokens"] > s["running"]]

    def mean(xs):
        return statistics.fmean(xs) * 1e3 if xs else None

    gaps = [b["t0"] - a["t1"] for a, b in zip(steps, steps[1:])]
    intervals = [b["t0"] - a["t0"] for a, b in zip(decode, decode[1:]) if b is not a]
    return {
        "steps": len(steps), "stream": steps[0].get("stream", True), "duration_s": t_end - t_start,
        "tokens": sum(s["tokens"] for s in steps), "peak_running": peak,
        "adds": len(adds), "adds_span_s": (max(adds) - min(adds)) if adds else None,
        "first_add_to_first_step_ms": (t_start - min(adds)) * 1e3 if adds else None,
        "prefill_steps": len(prefill), "prefill_phase_s": (prefill[-1]["t1"] - t_start) if prefill else None,
        "decode_steps": len(decode),
        "decode_interval_ms": mean(intervals),
        "decode_step_ms": mean([s["t1"] - s["t0"] for s in decode]),
        "decode_wait_ms": mean([s["wait"] for s in decode]),
        "decode_launch_ms": mean([s["launch"] for s in decode]),
        "decode_host_ms": mean([s["t1"] - s["t0"] - s["wait"] for s in decode]),
        "gap_between_steps_ms": mean(gaps),
        "emit_ms": mean([e["t1"] - e["t0"] for e in emits]),
        "server_apply_ms": mean([e["t1"] - e["t0"] for e in recv]),
        "emit_to_apply_ms": mean([r["t0"] - e["t1"] for e, r in pairs]),
        "busy_fraction": sum(s["t1"] - s["t0"] for s in steps) / (t_end - t_start),
    }


def timeline(files: dict[str, list[dict]]) -> dict | None:
    """The timed `bench serve` run through the three processes, in ms from its first request's send: when the
    requests were sent (client), reached the handler (server), were taken by the engine, streamed their first and
    last chunk (server) and got them (client). Medians and maxima over the run's requests."""
    clients = [[e for e in ev if e["k"] == "req"] for ev in files.values()]
    reqs = max(clients, key=len, default=[])
    if not reqs:
        return None
    reqs = sorted(reqs, key=lambda r: r["sent"])
    # The concurrent run, not the one-by-one warm-ups: from the last request sent after every earlier one ended.
    start = max((i for i in range(1, len(reqs)) if max(r["end"] for r in reqs[:i]) <= reqs[i]["sent"]), default=0)
    reqs = reqs[start:]
    t0, t1 = min(r["sent"] for r in reqs), max(r["end"] for r in reqs)
    http = [e for ev in files.values() for e in ev if e["k"] == "http" and t0 <= e["t_in"] <= t1]
    adds = [e["t"] for ev in files.values() for e in ev if e["k"] == "add" and t0 <= e["t"] <= t1]
    steps = [e for ev in files.values() for e in ev
             if e["k"] == "step" and e.get("stream", True) and t0 <= e["t0"] <= t1]

    def ms(t):
        return round((t - t0) * 1e3, 1) if t is not None else None

    def med(xs):
        xs = [x for x in xs if x is not None]
        return ms(statistics.median(xs)) if xs else None

    def top(xs):
        xs = [x for x in xs if x is not None]
        return ms(max(xs)) if xs else None

    return {"requests": len(reqs), "client_sent_last": top([r["sent"] for r in reqs]),
            "server_in_median": med([h["t_in"] for h in http]), "server_in_last": top([h["t_in"] for h in http]),
            "engine_add_first": ms(min(adds)) if adds else None, "engine_add_last": top(adds),
            "engine_first_step": ms(steps[0]["t0"]) if steps else None,
            "engine_last_step_end": ms(steps[-1]["t1"]) if steps else None,
            "server_first_chunk_median": med([h["first"] for h in http]),
            "client_first_token_median": med([r["first"] for r in reqs]),
            "server_last_chunk_median": med([h["last"] for h in http]),
            "server_last_chunk_last": top([h["last"] for h in http]),
            "client_end_median": med([r["end"] for r in reqs]), "client_end_last": ms(t1)}


def main() -> None:
    folder = Path(sys.argv[1])
    result = {}
    files = {f.stem: [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
             for f in sorted(folder.glob("trace-*.jsonl"))}
    recvs = [e for events in files.values() for e in events if e["k"] == "recv"]
    for name, events in files.items():
        if "--all-runs" in sys.argv:
            for i, run in enumerate(runs(events)):
                if len(run) >= 50:
                    result[f"{name}#{i}"] = summarize(events, recvs, i)
            continue
        s = summarize(events, recvs)
        if s is not None:
            result[name] = s
    line = timeline(files)
    if "--json" in sys.argv:
        print(json.dumps({"processes": result, "timeline_ms": line}, indent=1))
        return
    if line:
        print("timeline of the timed bench serve run, ms from its first request's send:")
        for k, v in line.items():
            print(f"  {k:28}{v!s:>12}")
    keys = sorted({k for s in result.values() for k in s})
    print(f"{'':28}" + "".join(f"{name[-14:]:>16}" for name in result))
    for k in keys:
        vals = [result[n].get(k) for n in result]
        print(f"{k:28}" + "".join(f"{v:>16.3f}" if isinstance(v, float) else f"{v!s:>16}" for v in vals))


if __name__ == "__main__":
    main()
