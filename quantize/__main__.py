"""`python -m vserve.quantize --model M --quant-method awq --output-dir D`: the seeds' spelling of `vserve quantize M
--method awq --output-dir D` (every other flag as `vserve quantize` takes it)."""

from __future__ import annotations

import sys

RENAMED = {"--quant-method": "--method"}


def main(argv: list[str] | None = None) -> None:
    from vserve.cli.main import app

    args, rest = [], list(sys.argv[1:] if argv is None else argv)
    model = None
    while rest:
        a = rest.pop(0)
        name, eq, value = a.partition("=")
        if name == "--model":
            model = value if eq else (rest.pop(0) if rest else "")
            continue
        args.append(RENAMED.get(name, name) + (eq + value if eq else ""))
    app(["quantize", *([model] if model is not None else []), *args], prog_name="python -m vserve.quantize")


if __name__ == "__main__":
    main()
