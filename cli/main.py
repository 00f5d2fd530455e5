"""The `vserve` entry point: the typer app and its commands. Importing it imports no torch."""

from __future__ import annotations

import typer

import vserve
from vserve.cli import bench, profiles
from vserve.cli.doctor import doctor
from vserve.cli.download import download
from vserve.cli.generate import generate
from vserve.cli.quantize import quantize
from vserve.cli.serve import serve

app = typer.Typer(name="vserve", help="vserve: an LLM serving toolkit (paged KV cache, continuous batching).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
app.command("generate")(generate)
app.command("serve")(serve)
app.add_typer(bench.app, name="bench")
app.add_typer(profiles.app, name="profiles")
app.command("doctor")(doctor)
app.command("quantize")(quantize)
app.command("download")(download)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(vserve.__version__)
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """vserve: an LLM serving toolkit (paged KV cache, continuous batching)."""


if __name__ == "__main__":
    app()
