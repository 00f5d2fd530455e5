"""`vserve quantize`: parse, run vserve.quantize.pipeline, print the summary (no torch at import)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from vserve.cli.engine_args import exit_on_bad_input
from vserve.quantize.options import BACKENDS, CALIBRATION_DEFAULTS, METHODS, QuantizeOptions

console = Console(highlight=False)
CPU = CALIBRATION_DEFAULTS["cpu"]


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _alphas(alphas: list[float | None]) -> str:
    """"mean 0.71 over 60 groups, 30 of 90 left unsmoothed" (None: a group SmoothQuant's search did not smooth)."""
    chosen = [a for a in alphas if a is not None]
    if not chosen:
        return f"all {len(alphas)} groups left unsmoothed"
    text = f"mean {sum(chosen) / len(chosen):.2f} over {len(chosen)} groups"
    if len(chosen) < len(alphas):
        text += f", {len(alphas) - len(chosen)} of {len(alphas)} left unsmoothed"
    return text


def quantize(
    model: str | None = typer.Argument(None, metavar="[MODEL]", show_default=False,
                                       help="HF model folder, .gguf file or hub id org/name (default: the embedded "
                                            "SmolLM2-135M)."),
    method: str = typer.Option(..., "--method", "-m", help=f"{' | '.join(METHODS)}", show_default=False),
    output_dir: Path = typer.Option(..., "--output-dir", "-o", help="Folder to write (must be new or empty).",
                                    show_default=False),
    bits: int | None = typer.Option(None, help="4 (awq, gptq, rtn) or 8 (gptq, rtn, fp8, int8); default: 4 for "
                                    "awq/gptq/rtn, 8 for fp8/int8.", show_default=False),
    group_size: int = typer.Option(128, help="Input channels per scale (awq, gptq, rtn); SmolLM2 needs 64."),
    calib_data: str = typer.Option("shakespeare", help="Calibration text: shakespeare (8 comedies; Hamlet, which "
                                   "bench perplexity scores, is not among them), a .txt, or a .jsonl of {\"text\"}."),
    num_samples: int | None = typer.Option(None, help="Calibration samples (awq, gptq, int8 W8A8); default 128 on a "
                                           f"GPU, {CPU[0]} on a CPU.", show_default=False),
    seq_len: int | None = typer.Option(None, help=f"Tokens per calibration sample; default 512 on a GPU, {CPU[1]} on "
                                       "a CPU.", show_default=False),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N: where the calibration forwards and the "
                               "AWQ/GPTQ searches run (auto: cuda when torch sees a GPU); the model stays in CPU "
                               "memory and each decoder layer visits the device while it is quantized."),
    backend: str = typer.Option("native", help=f"{' | '.join(BACKENDS)}; autoawq runs AutoAWQ itself (awq only)."),
    sym: bool = typer.Option(False, "--sym", help="gptq: symmetric grid (zero point 2^(bits-1)), as Marlin needs."),
    desc_act: bool = typer.Option(False, "--desc-act", help="gptq: quantize columns by decreasing activation "
                                  "energy (act-order; g_idx is then not monotonic)."),
    weight_only: bool = typer.Option(False, "--weight-only", help="fp8, int8: W8A16, activations stay 16-bit."),
    gptq: bool = typer.Option(False, "--gptq", help="fp8, int8: round the weights with GPTQ's error feedback on "
                              "the calibration inputs instead of to nearest (as llm-compressor's W8A8 recipe)."),
    smoothquant_alpha: str | None = typer.Option(None, metavar="FLOAT|auto", help="fp8, int8 W8A8: SmoothQuant "
                                                 "migration strength in [0, 1], or auto: searched per group of "
                                                 "linears on the calibration inputs (int8's default; fp8 is not "
                                                 "smoothed unless given).", show_default=False),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --output-dir."),
    seed: int = typer.Option(0, help="Seed of the calibration sample choice."),
) -> None:
    """Quantize a model into a folder vserve (and vLLM) can serve: AWQ, GPTQ, RTN, FP8 or INT8."""
    opts = QuantizeOptions(method=method, output_dir=output_dir, bits=bits, group_size=group_size,
                           calib_data=calib_data, num_samples=num_samples, seq_len=seq_len, device=device,
                           backend=backend, sym=sym,
                           desc_act=desc_act, weight_only=weight_only, gptq=gptq, smoothquant_alpha=smoothquant_alpha,
                           overwrite=overwrite, seed=seed)
    with exit_on_bad_input():
        opts.validate()  # before torch is imported: a bad flag fails fast
        from vserve.quantize.pipeline import quantize as run

        summary = run(model, opts)
    table = Table(title=f"Quantized: {summary.scheme}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("output", str(summary.output_dir))
    table.add_row("backend", opts.backend)
    table.add_row("device", summary.device)
    if summary.num_layers >= 0:
        table.add_row("layers", f"{summary.num_layers} decoder layers, {summary.num_linears} linears quantized")
    calibration = f"{summary.calib_samples} x {summary.seq_len} tokens of {opts.calib_data}"
    if summary.calib_note:
        calibration += " (the CPU default; --num-samples/--seq-len to change it)"
    table.add_row("calibration", calibration if summary.calib_samples else "none needed")
    if summary.alphas:
        table.add_row("AWQ alpha" if opts.method == "awq" else "SmoothQuant alpha", _alphas(summary.alphas))
    table.add_row("time", f"{summary.seconds:.1f} s")
    ratio = summary.bytes_before / max(summary.bytes_after, 1)
    table.add_row("size", f"{_size(summary.bytes_before)} -> {_size(summary.bytes_after)} ({ratio:.1f}x smaller)")
    console.print(table)
