"""`vserve profiles list` and `vserve profiles show NAME`: the GPU profiles, as tables or JSON."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from vserve.cli.engine_args import exit_on_bad_input
from vserve.profiles import SIZE_CLASSES, GpuProfile, all_profiles, get_profile  # YAML only, no torch

app = typer.Typer(help="GPU profiles: datasheet figures and recommended engine settings.", no_args_is_help=True)
console = Console(highlight=False)


def _tf(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


@app.command("list")
def list_profiles(json_out: bool = typer.Option(False, "--json", help="Print a JSON list instead of the table")):
    """Every GPU profile, one line each."""
    with exit_on_bad_input():
        profiles = all_profiles()
    if json_out:
        typer.echo(json.dumps([p.as_dict() for p in profiles], indent=2))
        return
    table = Table(title="GPU profiles (vserve profiles show NAME)", title_justify="left")
    for col in ("name", "GPU", "memory", "GB/s", "bf16 TFLOP/s", "fp8 TFLOP/s"):
        table.add_column(col, no_wrap=col == "name")
    for p in profiles:
        table.add_row(p.name, p.display_name, f"{p.memory_gb:g} GB {p.memory_type}", f"{p.memory_bandwidth_gbps:g}",
                      _tf(p.dense_tflops["bf16"]), _tf(p.dense_tflops["fp8"]))
    console.print(table)


def _show(p: GpuProfile) -> None:
    facts = Table(title=f"{p.display_name} ({p.name})", title_justify="left", show_header=False)
    facts.add_column("key", style="bold")
    facts.add_column("value", overflow="fold")
    rows = [("vendor", p.vendor), ("architecture", p.architecture),
            ("memory", f"{p.memory_gb:g} GB {p.memory_type}" + (" (ECC keeps 1/16)" if p.ecc_reserves_memory else "")),
            ("planned with", f"{p.memory_bytes / (1 << 30):.1f} GiB"),
            ("memory bandwidth", f"{p.memory_bandwidth_gbps:g} GB/s"),
            *((f"dense {k} {'TOPS' if k == 'int8' else 'TFLOP/s'}", _tf(v)) for k, v in p.dense_tflops.items()),
            ("fp8", "yes" if p.fp8 else "no"), ("interconnect", p.interconnect),
            ("devices per board", str(p.devices_per_board)), ("datasheet", p.datasheet),
            *((f"--{k.replace('_', '-')}", str(v)) for k, v in p.engine.items())]
    for k, v in rows:
        facts.add_row(k, v)
    console.print(facts)
    by_size = Table(title="By model size", title_justify="left")
    for col in ("size class", "--tensor-parallel-size", "--quantization"):
        by_size.add_column(col)
    for c in SIZE_CLASSES:
        r = p.models[c]
        by_size.add_row(f"<= {c[:-1]}B" if c != "moe" else "MoE", str(r.tensor_parallel_size), r.quantization or "none")
    console.print(by_size)


@app.command("show")
def show(name: str = typer.Argument(..., help="A profile name from `vserve profiles list`"),
         json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables")):
    """One profile: its figures, engine settings and recommendations by model size."""
    with exit_on_bad_input():
        p = get_profile(name)
    if json_out:
        typer.echo(json.dumps(p.as_dict(), indent=2))
    else:
        _show(p)
