"""`python -m vserve.entrypoints.api_server --model M [engine flags]`: vLLM's module entry point (the seeds' Docker
CMD), the same server as `vserve serve` with the same flags."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from vserve.cli.main import app

    app(["serve", *(sys.argv[1:] if argv is None else argv)], prog_name="python -m vserve.entrypoints.api_server")


if __name__ == "__main__":
    main()
