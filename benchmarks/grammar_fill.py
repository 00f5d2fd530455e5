"""The host cost of structured outputs a step (issue #29): filling N rows' allowed-token bitmasks and advancing N
matchers, on this machine's cores, with xgrammar's batch matcher (its own threads) against a Python thread pool over
row chunks (xgrammar's single-row fill releases the GIL) and one row at a time.

    python benchmarks/grammar_fill.py [--tokenizer DIR] [--rows 256] [--threads 1,4,8,15] [--out DIR]
    python benchmarks/grammar_fill.py --cpu-smoke --out DIR   # 16 rows, threads 1,2 (CI: it runs)

Rows sit where a decode step finds them under `{"answer": {"type": "string"}}` (benchmarks/h200_rows.py's JSON row):
"string": all inside the free string, "mixed": spread over the object's structure and the string. The tokenizer:
--tokenizer, else $VSERVE_BENCH_TOKENIZER, else the embedded SmolLM2's. Not a user path: it isolates the grammar's
share of a step's host time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
PREFIXES = {"string": ['{"answer": "the quick brown fox'],
            "mixed": ['{', '{"answer"', '{"answer": ', '{"answer": "', '{"answer": "a b c', '{"answer": "x\\n y']}


def best_ms(fn, reps: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3, statistics.median(times) * 1e3


def time_case(xgr, grammar, prefixes: list[str], num_rows: int, vocab: int, threads: list[int], reps: int,
              token: int | None) -> dict:
    """(best, median) ms of each way to fill num_rows masks, and with `token` a step's advance of every matcher."""
    matchers = []
    for i in range(num_rows):
        m = xgr.GrammarMatcher(grammar)
        assert m.accept_string(prefixes[i % len(prefixes)])
        matchers.append(m)
    mask = xgr.allocate_token_bitmask(num_rows, vocab)

    def rows(a: int, b: int) -> None:
        for j in range(a, b):
            matchers[j].fill_next_token_bitmask(mask, j)

    out = {"serial_ms": best_ms(lambda: rows(0, num_rows), reps)}
    for t in threads:
        batch = xgr.BatchGrammarMatcher(max_threads=t)
        out[f"batch_{t}_ms"] = best_ms(lambda b=batch: b.batch_fill_next_token_bitmask(matchers, mask), reps)
        cuts = [num_rows * k // t for k in range(t + 1)]
        with ThreadPoolExecutor(t) as pool:
            out[f"pool_{t}_ms"] = best_ms(lambda p=pool, c=cuts: list(p.map(rows, c[:-1], c[1:])), reps)
    if token is not None:  # one token per row, then rolled back, so that every rep starts alike
        def advance() -> None:
            for m in matchers:
                m.accept_token(token)
                m.is_terminated()
            for m in matchers:
                m.rollback(1)
        out["accept_ms"] = best_ms(advance, reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=os.environ.get("VSERVE_BENCH_TOKENIZER"))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--threads", default="1,4,8,15")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.rows, args.threads, args.reps = 16, "1,2", 2
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from vserve.core.structured_output import GrammarCompiler, StructuredOutputsParams

    if args.tokenizer is None:
        from vserve.ops.assets import default_model_path

        args.tokenizer = str(default_model_path())
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tok)
    gc = GrammarCompiler(tok, vocab, {tok.eos_token_id})
    info = xgr.TokenizerInfo.deserialize_json(gc.tokenizer_info("xgrammar")[1])  # what the core receives
    grammar = xgr.CompiledGrammar.deserialize_json(gc.compile(StructuredOutputsParams(json=ANSWER)).compiled, info)
    threads = [int(t) for t in args.threads.split(",")]
    words = tok.encode(" the cat sat on a mat", add_special_tokens=False)
    result = {"rows": args.rows, "vocab": vocab, "cpus": len(os.sched_getaffinity(0)), "cases": {}}
    for case, prefixes in PREFIXES.items():
        row = time_case(xgr, grammar, prefixes, args.rows, vocab, threads, args.reps,
                        words[0] if case == "string" else None)
        result["cases"][case] = row
        print(case, {k: f"{v[0]:.3f} / {v[1]:.3f}" for k, v in row.items()}, "(best / median ms)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "grammar_fill.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
