"""`vserve download MODEL`: prefetch a hub model into the Hugging Face cache and print its local path."""

from __future__ import annotations

import typer

from vserve.cli.engine_args import exit_on_bad_input


def download(
    model: str = typer.Argument(..., metavar="MODEL", help="Hub id: org/name, or org/name:QUANT for one GGUF file"),
    revision: str | None = typer.Option(None, help="Branch, tag or commit (default: main)"),
    download_dir: str | None = typer.Option(None, help="Cache folder (default: HF_HUB_CACHE, else $HF_HOME/hub)"),
    gguf_file: str | None = typer.Option(None, help="The one GGUF file of the repo to fetch"),
    hf_token: str | None = typer.Option(None, help="Token for gated or private models (default: $HF_TOKEN)"),
    tokenizer_only: bool = typer.Option(False, "--tokenizer-only", help="Config, tokenizer and chat template "
                                        "only, no weights (for --load-format dummy or --tokenizer)"),
) -> None:
    """Download what serving MODEL needs (config, tokenizer, chat template, safetensors or one GGUF file; never
    pickle) into the cache, skipping files already there; prints the snapshot path (the GGUF file's for a GGUF)."""
    from vserve.core.hub import download as fetch

    with exit_on_bad_input():
        path = fetch(model, revision=revision, download_dir=download_dir, token=hf_token, gguf_file=gguf_file,
                     weights=not tokenizer_only)
    typer.echo(str(path))
