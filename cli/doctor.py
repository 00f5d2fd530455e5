"""`vserve doctor [MODEL]`: environment checks and a model's memory plan, as a rich report or JSON.

Exit status 0 when no check fails, 1 when one does (2 for bad input, as everywhere). Torch is imported only
when the command runs (probing needs it), never at import.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from vserve.cli.engine_args import exit_on_bad_input
from vserve.core.config import KV_CACHE_DTYPES, LORA_RANKS  # plain dataclass module, no torch

console = Console(highlight=False)
STYLE = {"ok": ("✓ ok", "green"), "warn": ("! warn", "yellow"), "fail": ("✗ fail", "red"), "skip": ("- skip", "dim")}


def doctor(
    model: str | None = typer.Argument(None, metavar="[MODEL]", help="HF folder, .gguf, config.json, hub id "
                                       "(org/name: its config from the cache or the hub, no weights) or a known "
                                       "shape name (llama-3.1-8b, llama-2-70b, mixtral-8x7b, ...) to plan memory for"),
    profile: str | None = typer.Option(None, help="NAME|auto: the GPU to plan for (default: the detected one)"),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", help="GPUs to shard over"),
    max_model_len: int | None = typer.Option(None, help="Longest sequence (default: the model's context length)"),
    quantization: str | None = typer.Option(None, help="Plan with awq, gptq, fp8 or int8 weights"),
    gpu_memory_utilization: float | None = typer.Option(None, help="Fraction of GPU memory (default: the "
                                                        "profile's)"),
    max_num_seqs: int | None = typer.Option(None, help="Most sequences in one step (default: the profile's)"),
    kv_cache_dtype: str = typer.Option("auto", help="auto or fp8: plan the KV cache in the model's dtype or fp8"),
    max_loras: int = typer.Option(0, help="LoRA adapter slots to plan for (--enable-lora --max-loras N; 0: none)"),
    max_lora_rank: int = typer.Option(16, help="LoRA rank the slots hold"),
    revision: str | None = typer.Option(None, help="Hub branch, tag or commit of a hub MODEL (default: main)"),
    download_dir: str | None = typer.Option(None, help="Hugging Face cache folder for a hub MODEL"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report"),
) -> None:
    """Check the GPU, driver, torch/Triton/NCCL and /dev/shm, and whether MODEL fits (with remedies)."""
    from vserve.ops import probe
    from vserve.ops.doctor import run_doctor

    with exit_on_bad_input():
        if tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {max_model_len}")
        if max_loras < 0:
            raise ValueError(f"--max-loras must be >= 0, got {max_loras}")
        if max_lora_rank not in LORA_RANKS:
            raise ValueError(f"--max-lora-rank must be one of {', '.join(map(str, LORA_RANKS))}, got {max_lora_rank}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        env = probe.probe_environment()
        report = run_doctor(env, model=model, profile=profile, tensor_parallel_size=tensor_parallel_size,
                            max_model_len=max_model_len, quantization=quantization,
                            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                            kv_cache_dtype=kv_cache_dtype, revision=revision, download_dir=download_dir,
                            max_loras=max_loras, max_lora_rank=max_lora_rank)
    if json_out:
        typer.echo(json.dumps(report.as_dict(), indent=2))
    else:
        render(report)
    raise typer.Exit(report.exit_code)


def render(report) -> None:
    from vserve.core.memory import fmt_bytes

    table = Table(title="vserve doctor", title_justify="left")
    for col in ("check", "status", "finding", "fix"):
        table.add_column(col, overflow="fold")
    for c in report.checks:
        label, style = STYLE[c.status]
        table.add_row(c.name, Text(label, style=style), c.finding, c.fix)
    console.print(table)
    p = report.plan
    if p is not None:
        plan = Table(title=f"Memory plan: {report.model} on {report.profile} (per GPU)", title_justify="left")
        plan.add_column("part")
        plan.add_column("size", justify="right")
        for part, n in (("weights", p.weights_bytes), ("activation peak", p.activation_bytes),
                        ("CUDA graph pool", p.cuda_graph_bytes), ("runtime (outside torch)", p.runtime_bytes),
                        *([("LoRA adapter slots", p.lora_bytes)] if p.lora_bytes else []),
                        ("KV cache", p.kv_cache_bytes), ("total", p.total_bytes),
                        (f"budget ({p.gpu_memory_utilization} x {fmt_bytes(p.gpu_memory_bytes or 0)})",
                         p.budget_bytes)):
            plan.add_row(part, fmt_bytes(n))
        plan.add_row("KV per token", fmt_bytes(p.kv_bytes_per_token))
        plan.add_row("KV blocks", f"{p.num_blocks} x {p.block_size} tokens")
        if p.prefix_cache_max_blocks is not None:
            plan.add_row("prefix cache cap (--cache-size-gb)", f"{p.prefix_cache_max_blocks} free blocks")
        plan.add_row("longest sequence that fits", str(p.max_model_len_fit))
        plan.add_row(f"sequences of {p.max_model_len} at once", f"{p.max_concurrency:.1f}")
        plan.add_row("verdict", Text(p.verdict, style={"fits": "green", "tight": "yellow", "oom": "red"}[p.verdict]))
        console.print(plan)
    if report.recommendation:
        r = report.recommendation
        console.print(f"{report.profile} recommends for a {r['size_class']} model: --tensor-parallel-size "
                      f"{r['tensor_parallel_size']}, --quantization {r['quantization'] or 'none'}")
    if report.remedies:
        rem = Table(title="Remedies, in order", title_justify="left")
        for col in ("remedy", "weights/GPU", "KV blocks", "at once", "verdict", "vserve serves it"):
            rem.add_column(col)
        for r in report.remedies:
            rem.add_row(r.action, fmt_bytes(r.plan.weights_bytes), str(r.plan.num_blocks),
                        f"{r.plan.max_concurrency:.1f} x {r.plan.max_model_len}", r.plan.verdict,
                        "yes" if r.supported else "not yet")
        console.print(rem)
    failed = [c.name for c in report.checks if c.status == "fail"]
    console.print(Text(f"{len(failed)} check(s) failed: {', '.join(failed)}", style="red") if failed
                  else Text("healthy: no check failed", style="green"))
