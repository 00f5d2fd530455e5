"""`vserve bench experiment paging`: the same total tokens as few long or many short sequences, paged KV
(vserve) against contiguous KV (HF transformers' static batching): KV memory, p90 latency, throughput CV."""

from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from vserve import SamplingParams
from vserve.cli.bench_datasets import random_workload
from vserve.cli.bench_metrics import percentile
from vserve.cli.engine_args import build_llm, engine_command
from vserve.ops.progress import progress_bar  # rich only, no torch

app = typer.Typer(help="The design experiments.", no_args_is_help=True)
console = Console(highlight=False)
DEFAULT_MIXES = "4x2048,32x256,16x512,2x2048+16x256"


@dataclass
class Mix:
    """`spec` like '2x2048+16x256': groups of (count, total length = prompt + output)."""

    spec: str
    groups: list[tuple[int, int]]

    @property
    def total_tokens(self) -> int:
        return sum(n * length for n, length in self.groups)

    @property
    def lengths(self) -> list[int]:
        return [length for n, length in self.groups for _ in range(n)]


def parse_mixes(value: str, output_len: int) -> list[Mix]:
    """'4x2048,32x256' -> mixes; every mix must hold the same total and every length exceed output_len."""
    mixes = []
    for spec in (s.strip() for s in value.split(",") if s.strip()):
        try:
            groups = [(int(n), int(length)) for n, length in (g.split("x") for g in spec.split("+"))]
        except ValueError:
            groups = []
        if not groups or any(n < 1 or length <= output_len for n, length in groups):
            raise ValueError(f"--mixes takes NxLEN[+NxLEN] items with N >= 1 and LEN > --output-len {output_len}, "
                             f"got {spec!r}")
        mixes.append(Mix(spec, groups))
    if not mixes:
        raise ValueError("--mixes is empty")
    if len({m.total_tokens for m in mixes}) != 1:
        raise ValueError("every mix must hold the same total tokens, got "
                         + ", ".join(f"{m.spec} = {m.total_tokens}" for m in mixes))
    return mixes


def cv(values: list[float]) -> float:
    """Coefficient of variation: population std / mean."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean if mean else 0.0


def run_paged(engine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, list[float], int]:
    """(elapsed s, per-request latencies s, peak KV blocks in use) for one batch through vserve's engine."""
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=output_len)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    latencies, peak = [], 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        s = engine.stats()  # live for an in-process core, else as of the engine process's last step
        peak = max(peak, s.num_blocks - s.num_free_blocks)
        now = time.perf_counter() - start
        latencies += [now for o in outs if o.finished]
    return time.perf_counter() - start, latencies, peak


def run_contiguous(model, prompts: list[list[int]], output_len: int, pad_id: int) -> float:
    """Elapsed s of one left-padded static batch (every request finishes with the batch)."""
    import torch
    from transformers import GenerationConfig

    from vserve.cli.bench import left_pad

    ids, mask = left_pad(prompts, pad_id, model.device)
    cfg = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - start


def summarize_runs(backend: str, mix: Mix, elapsed: list[float], latencies: list[float], kv_bytes: int,
                   peak_gpu_bytes: int | None) -> dict[str, Any]:
    tok_s = [mix.total_tokens / e for e in elapsed]
    return {"backend": backend, "mix": mix.spec, "requests": len(mix.lengths), "total_tokens": mix.total_tokens,
            "tokens_per_s": sum(tok_s) / len(tok_s), "throughput_cv": cv(tok_s),
            "p90_latency_s": percentile(latencies, 90), "kv_peak_bytes": kv_bytes, "peak_gpu_bytes": peak_gpu_bytes}


def _peak_gpu(device) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@app.command("paging")
@engine_command
def paging(
    mixes: str = typer.Option(DEFAULT_MIXES, help="Comma-separated NxLEN[+NxLEN] mixes of equal total tokens; "
                              "LEN = prompt + output tokens."),
    output_len: int = typer.Option(64, help="Output tokens per request (the rest of LEN is prompt)."),
    repeats: int = typer.Option(3, help="Timed runs per mix and backend (throughput CV is over these)."),
    contiguous: bool = typer.Option(True, help="Also run HF transformers' static batching (contiguous KV)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Paged vs contiguous KV on equal-token mixes: KV peak, p90 latency, throughput CV."""
    from vserve.cli.bench import hf_model_folder, load_hf

    if output_len < 1 or repeats < 1:
        raise ValueError(f"--output-len and --repeats must be >= 1, got {output_len} and {repeats}")
    plan = parse_mixes(mixes, output_len)
    hf_folder = hf_model_folder(engine_args) if contiguous else None
    longest = max(max(m.lengths) for m in plan)
    llm = build_llm({**engine_args, "max_model_len": engine_args["max_model_len"] or longest})
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    per_token = engine.model_config.kv_bytes_per_token(engine.dtype.itemsize)
    block_bytes = per_token * engine.config.block_size
    vocab, special = min(engine.model_config.vocab_size, len(tok)), set(tok.all_special_ids)

    def workload(mix: Mix, r: int) -> list[list[int]]:
        # A fresh seed per repeat: the prefix cache never serves a repeat from an earlier one.
        prompts: list[list[int]] = []
        for n, length in mix.groups:
            prompts += random_workload(1000 * r + length, n, (length - output_len,) * 2, (1, 1), vocab,
                                       special).prompts
        return prompts

    rows = []
    llm.generate([[5] * 8], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    for mix in progress_bar(plan, len(plan), "paging: vserve (paged)"):
        elapsed, lats, peak_blocks = [], [], 0
        _reset_peak(engine.device)
        for r in range(repeats):
            e, lat, peak = run_paged(engine, workload(mix, r), output_len, f"{mix.spec}-{r}")
            elapsed.append(e)
            lats += lat
            peak_blocks = max(peak_blocks, peak)
        rows.append(summarize_runs("paged (vserve)", mix, elapsed, lats, peak_blocks * block_bytes,
                                   _peak_gpu(engine.device)))
    notes = [f"KV peak: paged = most KV blocks in use at once x {block_bytes:,} B (block {engine.config.block_size}); "
             "contiguous = batch x padded length x bytes per token (HF's cache for a padded static batch)."]
    if hf_folder is not None:
        dtype, device = engine.dtype, engine.device
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        del llm, engine
        gc.collect()
        model = load_hf(*hf_folder, dtype, device, bool(engine_args["trust_remote_code"]))
        run_contiguous(model, [[5] * 8], 2, pad_id)  # warm-up
        for mix in progress_bar(plan, len(plan), "paging: HF static batch (contiguous)"):
            _reset_peak(device)
            elapsed = []
            for r in range(repeats):
                elapsed.append(run_contiguous(model, workload(mix, r), output_len, pad_id))
            padded = max(mix.lengths)
            kv = len(mix.lengths) * padded * per_token
            # Static batching: every request's latency is the batch's.
            rows.append(summarize_runs("contiguous (HF static)", mix, elapsed,
                                       [e for e in elapsed for _ in mix.lengths], kv, _peak_gpu(device)))
        notes.append("HF runs greedy, vserve samples (temperature 1); both produce exactly --output-len tokens.")
    show_gpu = any(r["peak_gpu_bytes"] is not None for r in rows)
    if not show_gpu:
        notes.append("peak GPU memory is shown on CUDA only (torch.cuda.max_memory_allocated; vserve's includes its "
                     "preallocated KV pool).")
    report = {"mixes": [m.spec for m in plan], "output_len": output_len, "repeats": repeats, "rows": rows,
              "notes": notes}
    if as_json:
        typer.echo(json.dumps(report))
        return
    table = Table(title=f"Paging experiment: {plan[0].total_tokens:,} tokens per mix, {repeats} repeats",
                  title_justify="left")
    cols = ("backend", "mix", "requests", "tok/s", "throughput CV", "p90 latency s", "KV peak MiB")
    for col in cols + (("peak GPU MiB",) if show_gpu else ()):
        table.add_column(col, justify="left" if col in ("backend", "mix") else "right")
    for r in rows:
        gpu = (f"{r['peak_gpu_bytes'] / 2**20:,.1f}",) if show_gpu else ()
        table.add_row(r["backend"], r["mix"], str(r["requests"]), f"{r['tokens_per_s']:,.1f}",
                      f"{r['throughput_cv']:.3f}", f"{r['p90_latency_s']:.3f}", f"{r['kv_peak_bytes'] / 2**20:,.2f}",
                      *gpu)
    console.print(table)
    for note in notes:
        console.print(f"note: {note}", style="dim", markup=False)
