"""`vserve bench latency`: one batch of fixed-length requests, end to end, over several iterations."""

from __future__ import annotations

import json
import time
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from vserve import SamplingParams
from vserve.cli.bench_datasets import random_workload
from vserve.cli.bench_metrics import percentile
from vserve.cli.engine_args import build_llm
from vserve.ops.progress import progress_bar  # rich only, no torch

console = Console(highlight=False)
LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def run_batch(engine, prompts: list[list[int]], params, tag: str) -> tuple[float, float]:
    """(end-to-end s, TTFT s: until every request of the batch has its first token), stepping the engine."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    pending_first, ttft = set(ids), None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id in pending_first and out.outputs[0].token_ids:
                    pending_first.discard(out.request_id)
            if ttft is None and not pending_first:
                ttft = time.perf_counter() - start
    except BaseException:
        for rid in ids:
            engine.abort_request(rid)
        raise
    return time.perf_counter() - start, ttft if ttft is not None else 0.0


def summarize_latency(e2e: list[float], ttft: list[float], batch_size: int, output_len: int) -> dict[str, Any]:
    """Mean and LATENCY_PERCENTILES of end-to-end latency (s), mean TTFT (s), decode tokens/s."""
    decode = [(t - f) for t, f in zip(e2e, ttft)]
    decode_tokens = batch_size * (output_len - 1)
    return {"avg_latency_s": sum(e2e) / len(e2e),
            **{f"p{p}_latency_s": percentile(e2e, p) for p in LATENCY_PERCENTILES},
            "avg_ttft_s": sum(ttft) / len(ttft),
            "decode_tokens_per_s": decode_tokens / max(sum(decode) / len(decode), 1e-9) if decode_tokens else 0.0,
            "latencies_s": e2e, "ttfts_s": ttft}


def latency(
    batch_size: int = typer.Option(8, help="Requests in the batch."),
    input_len: int = typer.Option(32, help="Prompt tokens per request."),
    output_len: int = typer.Option(128, help="Output tokens per request (eos ignored)."),
    num_iters: int = typer.Option(10, help="Timed iterations."),
    num_iters_warmup: int = typer.Option(2, help="Untimed iterations first."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """End-to-end latency of one batch (vLLM's benchmark_latency): percentiles, TTFT, decode tok/s."""
    for flag, v in (("--batch-size", batch_size), ("--input-len", input_len), ("--output-len", output_len),
                    ("--num-iters", num_iters)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {num_iters_warmup}")
    llm = build_llm(engine_args)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    if input_len + output_len > engine.max_model_len:
        raise ValueError(f"--input-len {input_len} + --output-len {output_len} exceeds --max-model-len "
                         f"{engine.max_model_len}")
    vocab = min(engine.model_config.vocab_size, len(tok))
    w = random_workload(engine_args["seed"] or 0, batch_size, (input_len, input_len), (output_len, output_len),
                        vocab, set(tok.all_special_ids))
    # Prefix caching would serve later iterations' prompts from the first's blocks; each iteration gets
    # fresh prompts by rotating every prompt's tokens one place.
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)
    e2e, ttft = [], []
    for i in progress_bar(range(num_iters_warmup + num_iters), num_iters_warmup + num_iters, "bench latency"):
        prompts = [p[i % input_len:] + p[:i % input_len] for p in w.prompts] if i else w.prompts
        t, f = run_batch(engine, prompts, params, f"lat{i}")
        if i >= num_iters_warmup:
            e2e.append(t)
            ttft.append(f)
    report = {"batch_size": batch_size, "input_len": input_len, "output_len": output_len, "num_iters": num_iters,
              **summarize_latency(e2e, ttft, batch_size, output_len)}
    if as_json:
        typer.echo(json.dumps(report))
        return
    table = Table(title=f"Latency: batch {batch_size}, {input_len} in, {output_len} out, {num_iters} iterations",
                  title_justify="left")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("mean latency s", f"{report['avg_latency_s']:.4f}")
    for p in LATENCY_PERCENTILES:
        table.add_row(f"p{p} latency s", f"{report[f'p{p}_latency_s']:.4f}")
    table.add_row("mean TTFT s (whole batch)", f"{report['avg_ttft_s']:.4f}")
    table.add_row("decode tokens/s", f"{report['decode_tokens_per_s']:,.1f}")
    console.print(table)
