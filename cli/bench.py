"""`vserve bench`: the typer app; `throughput` (offline, optionally against HF transformers) lives here."""

from __future__ import annotations

import gc
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from vserve import SamplingParams
from vserve.cli import bench_experiment, bench_latency, bench_perplexity, bench_serve, bench_startup
from vserve.cli.bench_datasets import DATASETS, Workload, make_workload, parse_len, random_workload  # noqa: F401
from vserve.cli.engine_args import build_llm, engine_command
from vserve.cli.generate import read_schema
from vserve.ops.assets import DEFAULT_MODEL_NAME  # no torch
from vserve.ops.progress import make_progress  # rich only, no torch

app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
app.command("serve")(bench_serve.serve)
app.command("latency")(engine_command(bench_latency.latency))
app.command("perplexity")(engine_command(bench_perplexity.perplexity))
app.command("startup")(engine_command(bench_startup.startup))
app.add_typer(bench_experiment.app, name="experiment")
console = Console(highlight=False)
BACKENDS = ("vserve", "hf", "hf-batch")


@dataclass
class Result:
    backend: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float

    def as_dict(self) -> dict[str, Any]:
        e = max(self.elapsed_s, 1e-9)
        return {**asdict(self), "requests_per_s": self.num_requests / e,
                "output_tokens_per_s": self.output_tokens / e,
                "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / e}


def special_ids(tok) -> set[int]:
    """Every special token: the tokenizer's added special tokens too (as `bench serve` reads them), so
    both commands draw the same workload from the same flags."""
    added = getattr(tok, "added_tokens_decoder", {})
    return set(tok.all_special_ids) | {i for i, t in added.items() if t.special}


def run_vserve(llm, w: Workload, extra: dict[str, Any] | None = None, extra_fraction: float = 1.0,
               loras: list | None = None, details: dict[str, Any] | None = None,
               lens: list[int] | None = None) -> Result:
    """lens: filled with each request's generated length, in the workload's order."""
    # vLLM's throughput bench: temperature 1, top_p 1, eos ignored, exactly the requested output length. extra
    # (repetition_penalty, logprobs) goes to an evenly spread extra_fraction of the requests.
    extra = extra or {}

    def takes_extra(i: int) -> bool:
        return int((i + 1) * extra_fraction) > int(i * extra_fraction)

    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=o,
                             **(extra if takes_extra(i) else {})) for i, o in enumerate(w.output_lens)]
    # Warm-up; 8 tokens are less than the smallest block, so the prefix cache keeps nothing the run reuses.
    llm.generate([w.prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    if "structured_outputs" in extra:
        # and the structured path's one-time costs outside the timed run, as the line above takes the plain path's
        # (kernel compiles, CUDA graphs): the core's first grammar (the tokenizer's grammar info and this schema,
        # deserialized) and the bitmask kernel's compile. Reported as first_structured_request_s.
        t0 = time.perf_counter()
        llm.generate([w.prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True,
                                                        structured_outputs=extra["structured_outputs"]),
                     use_tqdm=False)
        if details is not None:
            details["first_structured_request_s"] = time.perf_counter() - t0
    if loras:  # and each adapter read once (CPU copies; slots while they are enough), outside the timed run
        llm.generate([w.prompts[0][:8]] * len(loras), SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False,
                     lora_request=loras)
    engine = llm.llm_engine
    before = engine.last_stats.grammar if engine.last_stats is not None else (0.0, 0, 0, 0.0, 0)
    start = time.perf_counter()
    # --num-loras: the adapters round-robin over the requests
    lora_request = [loras[i % len(loras)] for i in range(len(w.prompts))] if loras else None
    outs = llm.generate(w.prompts, params, use_tqdm=True, lora_request=lora_request)
    elapsed = time.perf_counter() - start
    if details is not None and "structured_outputs" in extra:
        details.update(grammar_times(before, engine.last_stats.grammar, elapsed))
    if lens is not None:
        lens.extend(len(o.outputs[0].token_ids) for o in outs)
    return Result("vserve", len(outs), sum(map(len, w.prompts)),
                  sum(len(c.token_ids) for o in outs for c in o.outputs), elapsed)


def grammar_times(before: tuple, after: tuple, elapsed: float) -> dict[str, Any]:
    """The core's host time on grammars over the run (CoreStats.grammar at its start and end): the bitmask fill
    per step with a constrained row (the core fills it while the step's forward runs), and the matchers' advance."""
    fill_s, calls, rows, accept_s, tokens = (b - a for a, b in zip(before, after))
    return {"steps_with_grammar": calls,
            "bitmask_fill_ms_per_step": 1e3 * fill_s / max(calls, 1),
            "bitmask_rows_per_step": rows / max(calls, 1),
            "accept_us_per_token": 1e6 * accept_s / max(tokens, 1),
            "accept_ms_per_step": 1e3 * accept_s / max(calls, 1),
            "elapsed_ms_per_step": 1e3 * elapsed / max(calls, 1)}


def compile_times(llm, structured) -> dict[str, Any]:
    """The front end's grammar costs before the run: the tokenizer's grammar info (once per engine), the schema's
    first compile (cold) and a second request's (the front end's cache)."""
    grammars = llm.llm_engine.processor.grammars
    t0 = time.perf_counter()
    grammars.tokenizer_info(grammars.backend if grammars.backend != "auto" else "xgrammar")
    t1 = time.perf_counter()
    grammars.compile(structured)
    t2 = time.perf_counter()
    grammars.compile(structured)
    t3 = time.perf_counter()
    return {"tokenizer_info_s": t1 - t0, "compile_cold_s": t2 - t1, "compile_cached_s": t3 - t2}


def lora_engine_args(engine_args: dict[str, Any], num_loras: int, rank: int) -> dict[str, Any]:
    """Engine args for --num-loras: LoRA on, every adapter resident unless --max-loras says otherwise, and
    --max-lora-rank at least the adapters' rank."""
    from vserve.core.config import LORA_RANKS

    if rank > LORA_RANKS[-1]:
        raise ValueError(f"--lora-rank must be <= {LORA_RANKS[-1]}, got {rank}")
    args = dict(engine_args)
    if args.get("enable_lora") is False:
        raise ValueError("--num-loras needs LoRA on (drop --no-enable-lora)")
    args["enable_lora"] = True
    args["max_loras"] = args.get("max_loras") or num_loras
    args["max_lora_rank"] = args.get("max_lora_rank") or next(r for r in LORA_RANKS if r >= rank)
    return args


def hf_model_folder(engine_args: dict[str, Any]) -> tuple[Path, str]:
    """The HF folder vserve loaded (the default model's converted folder when --model is not given)."""
    from vserve.core.config import EngineConfig
    from vserve.core.hub import resolve_model_files
    from vserve.core.model_config import resolve_model
    from vserve.ops.assets import default_model_path

    config = resolve_model_files(EngineConfig.resolve(engine_args))
    path, fmt = resolve_model(config.model or str(default_model_path()), config.load_format)
    if fmt == "gguf":
        raise ValueError(f"--backend hf needs an HF model folder (config.json + safetensors), got GGUF {path}")
    return path, fmt


def load_hf(folder: Path, fmt: str, dtype, device, trust_remote_code: bool):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI shows its own (rich) progress
    if fmt == "dummy":  # random weights, like vserve's --load-format dummy
        cfg = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def left_pad(prompts: list[list[int]], pad_id: int, device):
    """(input_ids, attention_mask) of one left-padded batch, on device."""
    import torch

    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    return ids.to(device), mask.to(device)


def run_hf_generate(model, w: Workload, pad_id: int) -> Result:
    """Static batching: every prompt in one left-padded batch, max(output_lens) new tokens for all."""
    import torch
    from transformers import GenerationConfig

    longest, new = max(map(len, w.prompts)), max(w.output_lens)
    ids, mask = left_pad(w.prompts, pad_id, model.device)
    # min_new_tokens == max_new_tokens: eos can never end a row early.
    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(input_ids=ids[:1, -8:], attention_mask=mask[:1, -8:],  # warm-up
                       generation_config=GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=pad_id))
        _sync(model.device)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        _sync(model.device)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == longest + new, out.shape
    return Result("hf generate", len(w.prompts), sum(map(len, w.prompts)), sum(w.output_lens), elapsed)


def run_hf_generate_batch(model, w: Workload) -> Result:
    """transformers' continuous batching (`generate_batch`, transformers >= 5), eos disabled (-1)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max(w.output_lens), do_sample=False, eos_token_id=-1)
    # Warm-up of the first call's one-time costs; each call still sizes and warms its own manager (timed).
    model.generate_batch([w.prompts[0][:8]], generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=-1))
    start = time.perf_counter()
    outs = model.generate_batch(w.prompts, generation_config=cfg)
    _sync(model.device)
    elapsed = time.perf_counter() - start
    failed = [k for k, o in outs.items() if o.error is not None]
    if len(outs) != len(w.prompts) or failed:
        raise RuntimeError(f"HF generate_batch returned {len(outs)} of {len(w.prompts)} requests; failed: {failed}")
    assert all(len(o.generated_tokens) == max(w.output_lens) for o in outs.values())
    return Result("hf generate_batch", len(outs), sum(map(len, w.prompts)), sum(w.output_lens), elapsed)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf(engine_args: dict[str, Any], folder: Path, fmt: str, w: Workload, dtype, device,
           pad_id: int, static: bool = True) -> list[Result]:
    """HF transformers on the same requests: generate with static batching (unless not static), then
    generate_batch."""
    results = []
    with make_progress() as progress:
        task = progress.add_task("HF transformers: load", total=3)
        model = load_hf(folder, fmt, dtype, device, bool(engine_args["trust_remote_code"]))
        if static:
            progress.update(task, advance=1, description="HF transformers: generate (static batch)")
            results.append(run_hf_generate(model, w, pad_id))
        else:
            progress.update(task, advance=1)
        progress.update(task, advance=1, description="HF transformers: generate_batch (continuous)")
        results.append(run_hf_generate_batch(model, w))
        progress.update(task, advance=1, description="HF transformers: done")
    return results


def render(results: list[Result], notes: list[str]) -> None:
    """Metrics as rows, backends as columns: fits a terminal however many backends ran."""
    table = Table(title="Offline throughput", title_justify="left")
    table.add_column("")
    for r in results:
        table.add_column(r.backend, justify="right")
    rows = [r.as_dict() for r in results]
    for label, key, fmt in (("requests", "num_requests", "{:,}"), ("prompt tokens", "prompt_tokens", "{:,}"),
                            ("output tokens", "output_tokens", "{:,}"), ("elapsed s", "elapsed_s", "{:.2f}"),
                            ("requests/s", "requests_per_s", "{:.2f}"),
                            ("output tokens/s", "output_tokens_per_s", "{:,.1f}"),
                            ("total tokens/s", "total_tokens_per_s", "{:,.1f}")):
        table.add_row(label, *(fmt.format(r[key]) for r in rows))
    if len(results) > 1:
        # Same requests and token counts in every column, so one ratio covers req/s and both tok/s rows.
        table.add_row("vserve / this", "", *(f"{r.elapsed_s / max(results[0].elapsed_s, 1e-9):.2f}x"
                                             for r in results[1:]), style="bold")
    console.print(table)
    for note in notes:
        console.print(f"note: {note}", style="dim", markup=False)


@app.command("throughput")
@engine_command
def throughput(
    num_prompts: int = typer.Option(100, help="Number of requests."),
    input_len: str = typer.Option("128", help="Prompt length in tokens: N, or A:B for uniform in [A, B]."),
    output_len: str = typer.Option("128", help="Output length in tokens: N, or A:B for uniform in [A, B]."),
    dataset: str = typer.Option("random", help=f"{' | '.join(DATASETS)} (docs/benchmarking.md)."),
    dataset_path: str = typer.Option(None, help="Prompts file for --dataset file (.txt or .jsonl)."),
    prefix_len: int = typer.Option(256, help="Shared prefix length for --dataset prefix."),
    num_prefixes: int = typer.Option(1, help="Distinct prefixes for --dataset prefix."),
    backend: str = typer.Option("vserve", help="vserve, or hf: also run HF transformers on the same requests "
                                "(generate with static batching, and generate_batch) and print the ratios; "
                                "hf-batch: generate_batch alone."),
    repetition_penalty: float = typer.Option(None, help="Repetition penalty of the requests --sampling-fraction "
                                             "picks (default: none)."),
    logprobs: int = typer.Option(None, help="Top logprobs per token for the requests --sampling-fraction picks."),
    sampling_fraction: float = typer.Option(1.0, help="Fraction of the requests (spread evenly) that take "
                                            "--repetition-penalty and --logprobs."),
    num_loras: int = typer.Option(0, help="Random rank --lora-rank LoRA adapters on q/k/v/o/gate/up/down, spread "
                                  "round-robin over the requests (turns on --enable-lora; --max-loras defaults to "
                                  "this)."),
    lora_rank: int = typer.Option(16, help="Rank of the --num-loras adapters."),
    json_schema: Path = typer.Option(None, "--json-schema", help="A JSON schema the requests --sampling-fraction "
                                     "picks must follow (structured output); a request ends when its JSON is "
                                     "complete, so output tokens are what was generated. Then the same requests "
                                     "run again without the schema, each to the length it generated (prompts "
                                     "reversed: no prefix-cache hits), for the schema's cost at equal lengths."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Offline throughput of a workload (random, file, chat, prefix) with exact output lengths (eos ignored)."""
    if num_loras < 0 or lora_rank < 1:
        raise ValueError(f"--num-loras must be >= 0 and --lora-rank >= 1, got {num_loras} and {lora_rank}")
    if num_loras:
        if backend != "vserve":
            raise ValueError("--num-loras runs vserve only (--backend vserve)")
        engine_args = lora_engine_args(engine_args, num_loras, lora_rank)
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if not 0.0 <= sampling_fraction <= 1.0:
        raise ValueError(f"--sampling-fraction must be in [0, 1], got {sampling_fraction}")
    extra = {k: v for k, v in dict(repetition_penalty=repetition_penalty, logprobs=logprobs).items()
             if v is not None}
    SamplingParams(**extra)  # bad values fail here, before the model loads
    if json_schema is not None:
        if backend != "vserve":
            raise ValueError("--json-schema runs vserve only (--backend vserve)")
        extra["structured_outputs"] = read_schema(json_schema)
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    in_len, out_len = parse_len("--input-len", input_len), parse_len("--output-len", output_len)
    seed = engine_args["seed"] or 0
    hf_folder = hf_model_folder(engine_args) if backend != "vserve" else None  # refuse a GGUF before any work

    llm = build_llm(engine_args)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    vocab = min(engine.model_config.vocab_size, len(tok))
    w = make_workload(dataset, seed=seed, num_prompts=num_prompts, input_len=in_len, output_len=out_len,
                      vocab_size=vocab, special_ids=special_ids(tok),
                      encode=lambda t: tok.encode(t, add_special_tokens=False), dataset_path=dataset_path,
                      prefix_len=prefix_len, num_prefixes=num_prefixes, max_len=engine.max_model_len)
    longest = max(len(p) + o for p, o in zip(w.prompts, w.output_lens))
    if longest > engine.max_model_len:
        raise ValueError(f"the workload has a request of {longest} tokens (prompt + output), more than "
                         f"--max-model-len {engine.max_model_len}")
    lora_dir = tempfile.TemporaryDirectory(prefix="vserve-bench-lora-") if num_loras else None
    loras = None
    details: dict[str, Any] = {}
    if json_schema is not None:
        details.update(compile_times(llm, extra["structured_outputs"]))
    if lora_dir is not None:
        from vserve.core.lora.dummy import write_dummy_adapters

        loras = write_dummy_adapters(Path(lora_dir.name), engine.model_config, num_loras, lora_rank, seed)
    lens: list[int] | None = [] if json_schema is not None else None
    try:
        results = [run_vserve(llm, w, extra, sampling_fraction, details=details, lens=lens,
                              **({"loras": loras} if loras else {}))]
        if lens is not None:  # the schema's cost at equal lengths: the same requests unconstrained, each to its length
            plain = {k: v for k, v in extra.items() if k != "structured_outputs"}
            same = run_vserve(llm, Workload([p[::-1] for p in w.prompts], lens), plain, sampling_fraction)
            same.backend = "vserve, no schema"
            details["unconstrained_same_lengths"] = same.as_dict()
            details["ratio_same_lengths"] = same.elapsed_s / max(results[0].elapsed_s, 1e-9)
    finally:
        if lora_dir is not None:
            lora_dir.cleanup()
    # the planner's figures, and the LoRA slots' bytes as allocated (lora_slot_bytes)
    memory = {k: engine.info.memory_plan.get(k) for k in ("weights_bytes", "lora_bytes", "lora_slot_bytes",
                                                          "kv_cache_bytes", "num_blocks")}
    notes = []
    if hf_folder is not None:
        dtype, device = engine.dtype, engine.device
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        engine.shutdown()  # an engine process exits and gives its GPU memory back
        del llm, engine  # free vserve's weights and KV cache before loading the peer
        gc.collect()
        results += run_hf(engine_args, *hf_folder, w, dtype, device, pad_id, static=backend == "hf")
        notes.append(f"HF runs greedy in {str(dtype).removeprefix('torch.')} on {device}; vserve samples "
                     "(temperature 1, top_p 1).")
        notes.append("hf generate_batch's time includes building and warming its manager, which every call does.")
        if len(set(w.output_lens)) > 1:
            notes.append(f"HF generates the longest output length, {max(w.output_lens)} tokens, for every request "
                         "(one batch / one generation config); its output tokens count each request's own length, "
                         "as vserve's do.")
    report = {**results[0].as_dict(), "model": engine_args["model"] or DEFAULT_MODEL_NAME, "dataset": dataset,
              "input_len": list(in_len), "output_len": list(out_len), "seed": seed,
              "sampling": {**extra, **({"structured_outputs": str(json_schema)} if json_schema else {}),
                           "fraction": sampling_fraction} if extra else None,
              "lora": {"num_loras": num_loras, "rank": lora_rank, "max_loras": engine_args["max_loras"]}
              if num_loras else None}
    if details:
        report["structured"] = details
    report["memory"] = memory
    if len(results) > 1:
        report["peers"] = [r.as_dict() for r in results[1:]]
        report["ratios"] = {r.backend: report["output_tokens_per_s"] / max(r.as_dict()["output_tokens_per_s"], 1e-9)
                            for r in results[1:]}
        report["notes"] = notes
    if as_json:
        typer.echo(json.dumps(report))
    elif lens is not None:
        render([results[0], same], ["the second column: the same requests without the schema, each to the length it "
                                    "generated under it; the ratio row is the schema's throughput over it."])
    else:
        render(results, notes)
