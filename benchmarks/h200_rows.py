"""The recorded H200 rows of docs/performance.md (issue #24's acceptance 2 among them), each through the CLI as users
run it: a fresh `vserve ...` process per row, the tokenizer loaded (each model folder carries common.py's synthetic
word-level tokenizer: no real one exists offline on the device machines).

    python benchmarks/h200_rows.py --out $OUT [--groups startup,throughput,quant,serve] [--rows NAME,...]
    python benchmarks/h200_rows.py --out $OUT --groups hf        # the HF peer of the 8B 512-token row (~5 min)
    VSERVE_BENCH_TOKENIZER=DIR python benchmarks/h200_rows.py --out $OUT --groups structured
    python benchmarks/h200_rows.py --cpu-smoke --out /tmp/h200_rows

Every row: random weights (--load-format dummy, bf16), prompts of random token ids, eos ignored, temperature 1.
- startup: `vserve bench startup` for `serve` (process start to /health 200) and `generate` (to the first token), the
  Llama-3-8B shape, one start with an empty Triton cache and two with it filled; the phases each process reports.
- throughput: `vserve bench throughput`, 256 requests, prompts U[100,1024]: the Qwen2.5-0.5B and SmolLM2-135M shapes
  with 512 new tokens each; the 8B shape with outputs U[100,1024] and with 512; the 8B shape at batch 1 (prompt 128,
  512 new tokens).
- quant: the 8B shape with its quantization in config.json (dummy codes and scales): batch 1 for bf16, AWQ W4A16
  (group 128) and FP8 W8A8; 256 requests with outputs U[100,1024] for bf16 and for FP8 W8A8 + `--kv-cache-dtype fp8`,
  one run of each first (it fills the Triton cache), then alternated twice: the ratio is the 1.4x goal's.
- serve: `vserve serve` (8B) and `vserve bench serve --max-concurrency 64`, 256 requests, prompts U[100,1024], 512 new
  tokens, streamed: TTFT, TPOT and ITL (p99 against p50).
- hf (not run unless named): the 8B 512-token row with `--backend hf` (HF generate and generate_batch, same requests).
- moe (not run unless named): the Mixtral-8x7B (bf16, ~93 GB: one H200) and DeepSeek-V2-Lite shapes, 256 requests
  U[100,1024] -> 512 new tokens (issue #26); moe_hf: the same with `--backend hf-batch`, and `_quarter` on the first
  64 requests (HF's MoE layers loop over the experts in eager torch); moe_h100: Mixtral-8x7B's
  layer shape at 16 of its 32 layers (~47 GB), for an 80 GB card.
- families (not run unless named): the Gemma-2-9B and Phi-3-mini-128k shapes, 256 requests U[100,1024] -> 512 new
  tokens, vserve alone (`{shape}_512`) and with `--backend hf-batch` (HF generate_batch on the same requests, in the
  same run; issue #25). HF's Gemma-2-9B run alone takes more than 9 minutes on an H100, so `{shape}_512_hf_batch_half`
  runs both on the first 128 of the requests (one device call each).
  8b_512_half_pen_lp: the 8B 512-token row with half the requests at repetition_penalty 1.1 and logprobs 5 (the
  ratio to 8b_512 is the 0.9x goal's).
- structured (not run unless named): the 8B body with SmolLM2's vocabulary and tokenizer (VSERVE_BENCH_TOKENIZER),
  256 requests U[100,1024] -> 512 new tokens, unconstrained and under a JSON schema of one free string (a request
  ends when its string closes): the ratio of output tokens/s is #29's 0.9x goal's; each JSON row also reports the
  compile times and the core's bitmask fill and matcher time per step; 8b_sv_512_json_guidance: the same under
  --structured-outputs-backend guidance (llguidance, carried by fetch_wheels.sh).
- lora (not run unless named): the 8B 512-token row without LoRA and with 1, 8 and 32 distinct rank-16 adapters on
  q/k/v/o/gate/up/down round-robin over the requests; batch 1 without and with one adapter; 5 resident adapters'
  slot bytes against the weights (issue #28's acceptance 4).
Each row's JSON goes to OUT/h200_rows.json as it ends; a table is printed last.
--cpu-smoke runs SMOKE_ROWS on a tiny shape in float32 on the CPU: the commands run, nothing is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import (  # benchmarks/ is sys.path[0]
    DEEPSEEK_V2_LITE,
    GEMMA2_9B,
    LLAMA3_8B,
    LLAMA3_8B_SV,
    MIXTRAL_8X7B,
    MIXTRAL_8X7B_16L,
    PHI3_MINI,
    QWEN25_05B,
    SMOLLM2,
    TINY,
    TINY_DEEPSEEK_V2,
    TINY_MIXTRAL,
    cli_json,
    model_folder,
    server,
)

SHAPES = {"8b": LLAMA3_8B, "8b_sv": LLAMA3_8B_SV, "qwen05b": QWEN25_05B, "smollm2": SMOLLM2, "gemma2_9b": GEMMA2_9B,
          "phi3_mini": PHI3_MINI, "mixtral_8x7b": MIXTRAL_8X7B, "mixtral_8x7b_16l": MIXTRAL_8X7B_16L,
          "deepseek_v2_lite": DEEPSEEK_V2_LITE}
SMOKE_SHAPES = {"mixtral_8x7b": TINY_MIXTRAL, "mixtral_8x7b_16l": TINY_MIXTRAL,  # --cpu-smoke; others: TINY
                "deepseek_v2_lite": TINY_DEEPSEEK_V2}
QUANT = {  # config.json's quantization_config of each method
    "bf16": None,
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": dict(num_bits=8, type="float", symmetric=True, strategy="channel",
                                                          dynamic=False),
                                          "input_activations": dict(num_bits=8, type="float", symmetric=True,
                                                                    strategy="token", dynamic=True)}}},
}
SMOKE_ROWS = ("startup_serve_8b", "startup_generate_8b", "qwen05b_512", "8b_512_half_pen_lp", "quant_bs1_awq",
              "quant_256_fp8_kv_fp8_warm", "serve_8b_c64", "mixtral_8x7b_512", "deepseek_v2_lite_512",
              "lora_8b_512_n8", "lora_8b_bs1_n1", "lora_8b_mem_n5")


@dataclass(slots=True)
class Sizes:
    """The workloads' sizes: the recorded rows', or `smoke()`'s for a CPU check."""

    num_prompts: int = 256
    input_len: str = "100:1024"
    output_len: str = "100:1024"
    new_tokens: str = "512"
    bs1_input: str = "128"
    bs1_output: str = "512"
    concurrency: int = 64
    warmups: int = 8
    cold_starts: int = 1
    warm_starts: int = 2
    repeats: int = 2  # the quant pair's alternations
    timeout_s: float = 560.0

    @classmethod
    def smoke(cls) -> Sizes:
        return cls(num_prompts=8, input_len="8:32", output_len="4:12", new_tokens="12", bs1_input="16",
                   bs1_output="16", concurrency=4, warmups=1, cold_starts=0, warm_starts=1, repeats=1,
                   timeout_s=240.0)


@dataclass(slots=True)
class Row:
    """One CLI call: `vserve ARGS --model FOLDER --load-format dummy ...` (serve: `bench serve ARGS` against
    `vserve serve FOLDER ...`)."""

    group: str
    name: str
    shape: str
    args: list[str]
    quant: str = "bf16"
    engine: list[str] = field(default_factory=list)  # engine flags beyond the model's


def rows(z: Sizes) -> list[Row]:
    def throughput(n, inp, out, *extra):
        return ["bench", "throughput", "--num-prompts", str(n), "--input-len", inp, "--output-len", out, *extra]

    bs1 = throughput(1, z.bs1_input, z.bs1_output, "--max-num-seqs", "8")
    startup = ["--num-iters-cold", str(z.cold_starts), "--num-iters-warm", str(z.warm_starts)]
    out = [Row("startup", f"startup_{mode}_8b", "8b", ["bench", "startup", "--mode", mode, *startup])
           for mode in ("serve", "generate")]
    out += [Row("throughput", "qwen05b_512", "qwen05b", throughput(z.num_prompts, z.input_len, z.new_tokens)),
            Row("throughput", "smollm2_512", "smollm2", throughput(z.num_prompts, z.input_len, z.new_tokens)),
            Row("throughput", "8b_u100_1024", "8b", throughput(z.num_prompts, z.input_len, z.output_len)),
            Row("throughput", "8b_512", "8b", throughput(z.num_prompts, z.input_len, z.new_tokens)),
            Row("throughput", "8b_512_half_pen_lp", "8b", throughput(
                z.num_prompts, z.input_len, z.new_tokens, "--repetition-penalty", "1.1", "--logprobs", "5",
                "--sampling-fraction", "0.5")),
            Row("throughput", "8b_bs1", "8b", bs1)]
    out += [Row("quant", f"quant_bs1_{q}", "8b", bs1, q) for q in ("bf16", "awq", "fp8")]
    pair = [("bf16", "auto"), ("fp8", "fp8")]
    for rep in ["warm", *(f"r{i + 1}" for i in range(z.repeats))]:
        out += [Row("quant", f"quant_256_{q}_kv_{kv}_{rep}", "8b", throughput(z.num_prompts, z.input_len, z.output_len),
                    q, ["--kv-cache-dtype", kv]) for q, kv in pair]
    out.append(Row("serve", "serve_8b_c64", "8b", [
        "--num-prompts", str(z.num_prompts), "--input-len", z.input_len, "--output-len", z.new_tokens,
        "--max-concurrency", str(z.concurrency), "--num-warmups", str(z.warmups), "--seed", "0"]))
    out.append(Row("hf", "8b_512_hf", "8b", throughput(z.num_prompts, z.input_len, z.new_tokens, "--backend", "hf")))
    for shape in ("gemma2_9b", "phi3_mini"):  # vserve alone, and with HF generate_batch after it in one process
        half = z.num_prompts // 2  # HF on all 256 requests runs past one device call (> 9 min for Gemma-2-9B)
        out += [Row("families", f"{shape}_512", shape, throughput(z.num_prompts, z.input_len, z.new_tokens)),
                Row("families", f"{shape}_512_hf_batch", shape, throughput(z.num_prompts, z.input_len, z.new_tokens,
                                                                           "--backend", "hf-batch")),
                Row("families", f"{shape}_512_hf_batch_half", shape, throughput(half, z.input_len, z.new_tokens,
                                                                                "--backend", "hf-batch"))]
    for shape in ("mixtral_8x7b", "deepseek_v2_lite"):
        quarter = z.num_prompts // 4  # HF's eager MoE layers loop over the experts: all 256 requests may not fit a call
        out += [Row("moe", f"{shape}_512", shape, throughput(z.num_prompts, z.input_len, z.new_tokens)),
                Row("moe_hf", f"{shape}_512_hf_batch", shape, throughput(z.num_prompts, z.input_len, z.new_tokens,
                                                                         "--backend", "hf-batch")),
                Row("moe_hf", f"{shape}_512_hf_batch_quarter", shape, throughput(quarter, z.input_len, z.new_tokens,
                                                                                 "--backend", "hf-batch"))]
    # an 80 GB card: Mixtral-8x7B's layer shape at 16 of its 32 layers (the full model is ~93 GB)
    out.append(Row("moe_h100", "mixtral_8x7b_16l_512", "mixtral_8x7b_16l",
                   throughput(z.num_prompts, z.input_len, z.new_tokens)))
    # structured outputs (#29): every request under a JSON schema of one free string; a request ends when the model
    # closes it (random weights: after ~100-200 tokens), so the ratio compares tokens/s of what was generated
    out += [Row("structured", "8b_sv_512", "8b_sv", throughput(z.num_prompts, z.input_len, z.new_tokens)),
            Row("structured", "8b_sv_512_json", "8b_sv", throughput(z.num_prompts, z.input_len, z.new_tokens,
                                                                    "--json-schema", str(ANSWER_SCHEMA))),
            Row("structured", "8b_sv_512_json_guidance", "8b_sv", throughput(
                z.num_prompts, z.input_len, z.new_tokens, "--json-schema", str(ANSWER_SCHEMA),
                "--structured-outputs-backend", "guidance"))]
    # multi-LoRA (#28): rank-16 adapters on q/k/v/o/gate/up/down, spread round-robin over the requests; the base
    # rows run in the same call; the memory row holds 5 adapters resident (its report's memory.lora_slot_bytes)
    lora = ["--lora-rank", "16"]
    out += [Row("lora", "lora_8b_512_base", "8b", throughput(z.num_prompts, z.input_len, z.new_tokens))]
    out += [Row("lora", f"lora_8b_512_n{n}", "8b", throughput(z.num_prompts, z.input_len, z.new_tokens,
                                                             "--num-loras", str(n), *lora)) for n in (1, 8, 32)]
    out += [Row("lora", "lora_8b_bs1_base", "8b", bs1),
            Row("lora", "lora_8b_bs1_n1", "8b", [*bs1, "--num-loras", "1", *lora]),
            Row("lora", "lora_8b_mem_n5", "8b", throughput(5, z.bs1_input, "16", "--num-loras", "5", *lora))]
    # 4-bit against bf16 (#31): decode at batch 1, 8 and 32 (128-token prompts, 512 new tokens, every request
    # admitted at once) and 256 requests U[100,1024] in and out; bf16, AWQ and GPTQ interleaved per size
    for size, n in (("bs1", 1), ("bs8", 8), ("bs32", 32)):
        out += [Row("w4", f"w4_{size}_{q}", "8b", throughput(n, z.bs1_input, z.bs1_output, "--max-num-seqs",
                                                             str(max(8, n))), q) for q in ("bf16", "awq", "gptq")]
    out += [Row("w4", f"w4_256_{q}", "8b", throughput(z.num_prompts, z.input_len, z.output_len), q)
            for q in ("bf16", "awq", "gptq")]
    return out


ANSWER_SCHEMA = Path(tempfile.gettempdir()) / "vserve-bench-answer-schema.json"
# Not a minLength to hold every request to 512 tokens: xgrammar's accept_token grows with the position under a large
# minLength (8192: 1 ms a token at 100 tokens, 8 ms at 400, measured on this CPU), which no user schema should have
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}


def run_serve(row: Row, folder: str, engine: list[str], timeout_s: float) -> dict:
    """`vserve serve` on the row's model, then `vserve bench serve` (streamed, token-id prompts) against it."""
    log = Path(tempfile.mkdtemp(prefix="vserve-rows-")) / "server.log"
    t0 = time.monotonic()
    with server([folder, *engine], log, timeout_s) as (url, _pid):
        start_s = time.monotonic() - t0
        report = cli_json(["bench", "serve", "--base-url", url, "--token-ids", "--tokenizer", folder, *row.args],
                          timeout_s)
    return {**report, "server_start_s": start_s}


def headline(r: dict) -> str:
    """A row's result in a few words: output tok/s, start-up seconds or the serving latencies."""
    if "error" in r:
        return "error: " + str(r["error"]).strip().splitlines()[-1][:100]
    if "output_tokens_per_s" in r:
        extra = ""
        if r.get("structured"):
            g = r["structured"]
            extra = (f"; compile cold {g['compile_cold_s'] * 1e3:.1f} ms, cached {g['compile_cached_s'] * 1e3:.2f} ms; "
                     f"bitmask {g['bitmask_fill_ms_per_step']:.2f} ms/step ({g['bitmask_rows_per_step']:.0f} rows), "
                     f"accept {g['accept_us_per_token']:.1f} us/token, step {g['elapsed_ms_per_step']:.1f} ms"
                     + (f"; first structured request {g['first_structured_request_s']:.2f} s"
                        if "first_structured_request_s" in g else "")
                     + (f"; {g['ratio_same_lengths']:.3f}x unconstrained at the same lengths"
                        if "ratio_same_lengths" in g else ""))
        if (r.get("memory") or {}).get("lora_slot_bytes"):
            m = r["memory"]
            extra += (f"; LoRA slots {m['lora_slot_bytes'] / 2**20:,.0f} MiB = "
                      f"{m['lora_slot_bytes'] / m['weights_bytes']:.1%} of the weights")
        return (f"{r['output_tokens_per_s']:,.1f} output tok/s ({r['output_tokens']} tokens, {r['elapsed_s']:.2f} s)"
                + extra)
    if r.get("mode") in ("serve", "generate"):
        return "; ".join(f"{run['cache']} {run['seconds']:.2f} s" for run in r.get("runs", []))
    if "runs" in r:
        x = r["runs"][0]
        return (f"{x['output_throughput']:,.1f} output tok/s; TTFT p50 {x['p50_ttft_ms']:,.1f} ms; ITL p50 "
                f"{x['p50_itl_ms']:.2f} / p99 {x['p99_itl_ms']:.2f} ms ({x['p99_itl_ms'] / x['p50_itl_ms']:.1f}x); "
                f"failed {x['failed']}")
    return json.dumps(r)[:120]


def ratios(res: dict) -> dict:
    """The quant rows' ratios to bf16 (batch 1, and each alternation of the 256-request pair)."""
    def tok_s(name):
        return res.get(name, {}).get("output_tokens_per_s")

    out = {}
    for q in ("awq", "fp8"):
        if tok_s(f"quant_bs1_{q}") and tok_s("quant_bs1_bf16"):
            out[f"bs1_{q}_over_bf16"] = tok_s(f"quant_bs1_{q}") / tok_s("quant_bs1_bf16")
    for size in ("bs1", "bs8", "bs32", "256"):
        for q in ("awq", "gptq"):
            if tok_s(f"w4_{size}_{q}") and tok_s(f"w4_{size}_bf16"):
                out[f"w4_{size}_{q}_over_bf16"] = tok_s(f"w4_{size}_{q}") / tok_s(f"w4_{size}_bf16")
    if tok_s("8b_512_half_pen_lp") and tok_s("8b_512"):
        out["half_pen_lp_over_plain"] = tok_s("8b_512_half_pen_lp") / tok_s("8b_512")
    for name in ("8b_sv_512_json", "8b_sv_512_json_guidance"):
        if tok_s(name) and tok_s("8b_sv_512"):
            out[name.replace("8b_sv_512_json", "json_schema") + "_over_plain"] = tok_s(name) / tok_s("8b_sv_512")
    for n in ("1", "8", "32"):
        if tok_s(f"lora_8b_512_n{n}") and tok_s("lora_8b_512_base"):
            out[f"lora_n{n}_over_base"] = tok_s(f"lora_8b_512_n{n}") / tok_s("lora_8b_512_base")
    if tok_s("lora_8b_bs1_n1") and tok_s("lora_8b_bs1_base"):
        out["lora_bs1_n1_over_base"] = tok_s("lora_8b_bs1_n1") / tok_s("lora_8b_bs1_base")
    for name in res:
        if name.startswith("quant_256_fp8_kv_fp8_") and tok_s(name.replace("fp8_kv_fp8", "bf16_kv_auto")):
            out[name.removeprefix("quant_256_") + "_over_bf16"] = tok_s(name) / tok_s(
                name.replace("fp8_kv_fp8", "bf16_kv_auto"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--groups", default="startup,throughput,quant,serve",
                    help="comma-separated (hf, families, moe, moe_hf, moe_h100, structured, lora, w4: not by default)")
    ap.add_argument("--rows", default="", help="row names, comma-separated (instead of --groups)")
    ap.add_argument("--cpu-smoke", "--smoke", action="store_true",
                    help="SMOKE_ROWS on a tiny shape on the CPU, float32: the commands run, nothing is measured")
    args = ap.parse_args(argv)
    sizes = Sizes.smoke() if args.cpu_smoke else Sizes()
    names = set(filter(None, args.rows.split(","))) or (set(SMOKE_ROWS) if args.cpu_smoke else set())
    groups = set(args.groups.split(","))
    todo = [r for r in rows(sizes) if r.name in names or (not names and r.group in groups)]
    device = ["--device", "cpu", "--dtype", "float32"] if args.cpu_smoke else ["--dtype", "bfloat16"]
    args.out.mkdir(parents=True, exist_ok=True)
    folders: dict[tuple[str, str], str] = {}
    res: dict = {"sizes": {k: getattr(sizes, k) for k in Sizes.__slots__}}
    t0 = time.monotonic()
    for row in todo:
        key = (row.shape, row.quant)
        if key not in folders:
            cfg = dict(SMOKE_SHAPES.get(row.shape, TINY) if args.cpu_smoke else SHAPES[row.shape])
            if QUANT[row.quant] is not None:
                cfg["quantization_config"] = QUANT[row.quant]
            tokenizer = None
            if row.shape == "8b_sv":  # a real tokenizer (JSON must be spellable) of SmolLM2's vocabulary
                tokenizer = os.environ.get("VSERVE_BENCH_TOKENIZER")
                if not tokenizer:
                    raise SystemExit("the structured rows need VSERVE_BENCH_TOKENIZER: a folder with SmolLM2's "
                                     "tokenizer.json")
                cfg.update(vocab_size=LLAMA3_8B_SV["vocab_size"], bos_token_id=1, eos_token_id=2)
                ANSWER_SCHEMA.write_text(json.dumps(ANSWER))
            folders[key] = model_folder(cfg, tokenizer)
        engine = ["--load-format", "dummy", *device, *row.engine]
        start = time.monotonic()
        if row.group == "serve":
            r = run_serve(row, folders[key], engine, sizes.timeout_s)
        else:
            r = cli_json([*row.args, "--model", folders[key], *engine], sizes.timeout_s)
        r["cli"] = (f"vserve serve MODEL {' '.join(engine)}; vserve bench serve --base-url URL --token-ids "
                    + " ".join(row.args)) if row.group == "serve" else " ".join(["vserve", *row.args, "--model MODEL",
                                                                                *engine])
        r["row_s"] = round(time.monotonic() - start, 2)
        res[row.name] = r
        res["ratios"] = ratios(res)
        res["total_s"] = round(time.monotonic() - t0, 1)
        (args.out / "h200_rows.json").write_text(json.dumps(res, indent=1))
        print(f"{row.name:34} {headline(r)}", flush=True)
    for k, v in res["ratios"].items():
        print(f"{k:34} {v:.3f}x")
    return 1 if any("error" in res[r.name] for r in todo) else 0


if __name__ == "__main__":
    sys.exit(main())
