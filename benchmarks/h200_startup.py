"""Issue #24's start-up rows and the tokenizer-on throughput row on the H200, through the CLI as users run it.

    PYTHONPATH=... python benchmarks/h200_startup.py --out $OUT [--smoke]

(1) `vserve bench startup` for `vserve serve` and `vserve generate` on the Llama-3-8B shape with dummy bf16 weights
    (cold and warm Triton cache; phases as each process reports them).
(2) `vserve bench throughput` on the Qwen2.5-0.5B shape (dummy bf16 weights), 256 requests, prompts U[100,1024],
    512 new tokens, tokenizer loaded (issue #24's 27.5k row; goal 60k).
Each model folder gets the synthetic word-level tokenizer of benchmarks/h200_bench.py (no real tokenizer exists
offline there). --smoke runs the same steps on a tiny shape on the CPU. JSON per step in OUT/h200_startup.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from h200_bench import TINY, model_folder  # benchmarks/ is sys.path[0]
from h200_engine import LLAMA3_8B, QWEN25_05B

CLI = [sys.executable, "-m", "vserve.cli.main"]


def cli_json(args: list[str], timeout: float) -> dict:
    start = time.monotonic()
    r = subprocess.run([*CLI, *args, "--json"], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        return {"error": r.stderr[-3000:], "returncode": r.returncode}
    return {**json.loads(r.stdout), "wall_s": time.monotonic() - start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU: the steps run, nothing measured")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    big, small = (TINY, TINY) if a.smoke else (LLAMA3_8B, QWEN25_05B)
    device = ["--device", "cpu", "--dtype", "float32"] if a.smoke else []
    results: dict[str, dict] = {}

    def record(name: str, value: dict) -> None:
        results[name] = value
        (a.out / "h200_startup.json").write_text(json.dumps(results, indent=1))
        print(name, json.dumps(value)[:1500], flush=True)

    folder = model_folder(big)
    engine = ["--model", folder, "--load-format", "dummy", *device]
    iters = ["--num-iters-cold", "1", "--num-iters-warm", "1" if a.smoke else "2"]
    record("startup_serve_8b", cli_json(["bench", "startup", "--mode", "serve", *iters, *engine], 560))
    record("startup_generate_8b", cli_json(["bench", "startup", "--mode", "generate", *iters, *engine], 560))
    n, out_len = ("8", "16") if a.smoke else ("256", "512")
    record("throughput_qwen05b_tokenizer_on", cli_json(
        ["bench", "throughput", "--model", model_folder(small), "--load-format", "dummy", *device,
         "--num-prompts", n, "--input-len", "100:1024" if not a.smoke else "8:32", "--output-len", out_len], 560))


if __name__ == "__main__":
    main()
