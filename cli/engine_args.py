"""The engine flags every engine-building command shares (vLLM's names), and the CLI's one error exit."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from vserve.core.config import (  # plain dataclass, no torch
    BLOCK_SIZES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
    STRUCTURED_OUTPUTS_BACKENDS,
    EngineConfig,
)
from vserve.ops import startup  # stdlib only

err_console = Console(stderr=True)
PANEL = "Engine options"
_DEFAULTS = {f.name: f for f in fields(EngineConfig)}


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag: its EngineConfig field, type and help; `decls` only where typer's default is wrong."""

    name: str
    type: type
    help: str
    default: str | None = None  # how to describe a None default; others are read from EngineConfig
    decls: tuple[str, ...] = ()

    def help_text(self) -> str:
        value = _DEFAULTS[self.name].default
        if value is None:
            return f"{self.help} (default: {self.default})" if self.default else self.help
        shown = ("on" if value else "off") if isinstance(value, bool) else value  # not 1 -> on: 1 == True
        return f"{self.help} (default: {shown})"

    def parameter(self) -> inspect.Parameter:
        # Default None everywhere, so EngineConfig.resolve can tell "given" from "default".
        option = typer.Option(None, *self.decls, help=self.help_text(), rich_help_panel=PANEL,
                              show_default=False)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                 annotation=self.type | None)


ENGINE_FLAGS = (
    EngineFlag("model", str, "HF model folder, .gguf file, or hub id org/name (org/name:Q4_K_M: one GGUF file)",
               "the embedded SmolLM2-135M-Instruct"),
    EngineFlag("tokenizer", str, "Tokenizer folder or hub id", "the model's"),
    EngineFlag("revision", str, "Hub branch, tag or commit of the model", "main"),
    EngineFlag("tokenizer_revision", str, "Hub branch, tag or commit of --tokenizer", "main"),
    EngineFlag("download_dir", str, "Hugging Face cache folder to find and download hub models in",
               "HF_HUB_CACHE, else $HF_HOME/hub"),
    EngineFlag("hf_token", str, "Hub token for gated or private models", "$HF_TOKEN"),
    EngineFlag("gguf_file", str, "The GGUF file of a hub repo to serve (or give the model as org/name:QUANT)"),
    EngineFlag("dtype", str, f"{' | '.join(DTYPES)}; auto keeps bf16 checkpoints bf16, else fp16 on GPU, "
                             "fp32 on CPU"),
    EngineFlag("max_model_len", int, "Longest sequence, prompt + output", "the model's context length"),
    EngineFlag("block_size", int, f"Tokens per KV block: {', '.join(map(str, BLOCK_SIZES))}"),
    EngineFlag("max_num_seqs", int, "Most sequences in one step"),
    EngineFlag("max_num_batched_tokens", int, "Token budget of one step"),
    EngineFlag("gpu_memory_utilization", float, "Fraction of GPU memory to use, in (0, 1]"),
    EngineFlag("enforce_eager", bool, "Never capture CUDA graphs", decls=("--enforce-eager",)),
    EngineFlag("async_scheduling", bool, "Schedule and build step N+1 while the GPU runs step N (outputs lag one "
               "step)", "on for one CUDA GPU, off on CPU and under TP/PP"),
    EngineFlag("engine_process", bool, "Run the engine core (scheduler, KV cache, model) in its own process, so "
               "detokenization and HTTP overlap its steps; off: in this process", "on for serve and on a GPU, off "
               "for offline runs on the CPU; off under TP/PP"),
    EngineFlag("enable_prefix_caching", bool, "Reuse the KV blocks of shared prompt prefixes"),
    EngineFlag("enable_chunked_prefill", bool, "Split long prompts across steps"),
    EngineFlag("long_prefill_token_threshold", int, "Most prompt tokens of one request in one step (the seeds' "
               "--chunk-size)", "the step's token budget", decls=("--long-prefill-token-threshold", "--chunk-size")),
    EngineFlag("cache_size_gb", float, "GiB (per GPU) the prefix cache may keep in blocks no request holds; the "
               "least recently used beyond it are evicted first", "every free block"),
    EngineFlag("quantization", str, f"{' | '.join(QUANTIZATION_METHODS)}: the checkpoint's quantization "
               "(docs/quantization.md)", "from config.json's quantization_config"),
    EngineFlag("kv_cache_dtype", str, f"{' | '.join(KV_CACHE_DTYPES)}; fp8 stores K and V as float8 e4m3 (scale 1, "
               "saturating): twice the tokens in the same memory, half the bytes attention reads"),
    EngineFlag("load_format", str, f"{' | '.join(LOAD_FORMATS)}; dummy: random weights"),
    EngineFlag("seed", int, "Random seed (generate also seeds each request with it)"),
    EngineFlag("tensor_parallel_size", int, "GPUs to shard each layer over", decls=("--tensor-parallel-size", "-tp")),
    EngineFlag("pipeline_parallel_size", int, "Pipeline stages to split the layers over",
               decls=("--pipeline-parallel-size", "-pp")),
    EngineFlag("nnodes", int, "Nodes the ranks are spread over (docs/parallelism.md)"),
    EngineFlag("node_rank", int, "This node's index; nodes other than 0 run ranks only"),
    EngineFlag("master_addr", str, "Node 0's address for the rendezvous"),
    EngineFlag("master_port", int, "Node 0's rendezvous port", "a free port (one node)"),
    EngineFlag("worker_addresses", str, "host:port per node, node 0's first (sets --nnodes, --master-addr and "
               "--master-port from the first)"),
    EngineFlag("trust_remote_code", bool, "Let the tokenizer run code from the model folder",
               decls=("--trust-remote-code",)),
    EngineFlag("skip_tokenizer_init", bool, "Load no tokenizer: prompts are token ids, outputs carry no text",
               decls=("--skip-tokenizer-init",)),
    EngineFlag("device", str, "auto | cpu | cuda; auto: cuda when available"),
    EngineFlag("kv_cache_memory_gib", float, "KV cache size in GiB", "sized by the engine from free memory"),
    EngineFlag("num_kv_blocks", int, "Force the number of KV blocks", "from the KV cache size"),
    EngineFlag("enable_lora", bool, "Serve LoRA adapters (docs/lora.md)"),
    EngineFlag("max_loras", int, "LoRA adapters resident on the device at once (so at most this many per batch)"),
    EngineFlag("max_cpu_loras", int, "LoRA adapters kept in host memory", "--max-loras"),
    EngineFlag("max_lora_rank", int, "Highest LoRA rank served: 8, 16, 32, 64, 128, 256, 320 or 512"),
    EngineFlag("structured_outputs_backend", str, f"{' | '.join(STRUCTURED_OUTPUTS_BACKENDS)}: the grammar engine of "
               "structured outputs and forced tool calls; auto: xgrammar, and llguidance (pip install "
               "'vserve[guidance]') for a grammar xgrammar cannot compile"),
    EngineFlag("profile", str, "GPU profile (vserve profiles list) or auto (detect the GPU): its recommended "
               "settings fill what other flags leave unset", "none"),
)


def fail(message: str) -> NoReturn:
    """The CLI's only error exit: one red `error: ...` line on stderr, status 2, no traceback."""
    err_console.print(Text("error: " + " ".join(message.split()), style="red"), soft_wrap=True)
    raise typer.Exit(2)


@contextmanager
def exit_on_bad_input() -> Iterator[None]:
    """ValueError is how core (and these commands) report bad input; turn it into `fail`."""
    try:
        yield
    except ValueError as e:
        fail(str(e))


def print_config(config: EngineConfig) -> None:
    table = Table(title="Engine config", title_justify="left")
    for col in ("flag", "value", "source"):
        table.add_column(col)
    for flag, value, source in config.describe():
        style = "bold" if source != "default" else None
        table.add_row(flag, "None" if value is None else str(value), source, style=style)
    err_console.print(table)


def engine_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Append the engine flags and --print-config to a command's signature.

    The command gets `engine_args`: {field: value or None} for every flag, validated through
    EngineConfig.resolve before the command runs (so a bad flag fails before torch is imported), and
    any ValueError it raises becomes one error line.
    """
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "engine_args"]
    show = inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
        False, "--print-config", help="Print the resolved engine config (flag, value, source), then run",
        rich_help_panel=PANEL))

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        startup.mark_imports()
        engine_args = {f.name: kwargs.pop(f.name) for f in ENGINE_FLAGS}
        with exit_on_bad_input():
            config = EngineConfig.resolve(engine_args, profile=None)
            if kwargs.pop("print_config"):
                print_config(config)
            if config.node_rank > 0:  # another node's ranks: no engine, no server here
                from vserve.core.worker import run_node

                if kwargs.get("model_arg") is not None:  # `vserve serve MODEL`
                    config = EngineConfig.resolve({**engine_args, "model": kwargs["model_arg"]})
                raise typer.Exit(run_node(config))
            return fn(engine_args=engine_args, **kwargs)

    command.__signature__ = sig.replace(parameters=own + [f.parameter() for f in ENGINE_FLAGS] + [show])
    return command


def engine_argv(engine_args: dict[str, Any]) -> list[str]:
    """The command-line flags that give these engine args (those not None) to another vserve command."""
    argv: list[str] = []
    for flag in ENGINE_FLAGS:
        value = engine_args.get(flag.name)
        name = "--" + flag.name.replace("_", "-")
        if value is None:
            continue
        if flag.type is bool:
            if value:
                argv.append(flag.decls[0] if flag.decls else name)
            elif not flag.decls:
                argv.append("--no-" + name[2:])
            continue
        argv += [flag.decls[0] if flag.decls else name, str(value)]
    return argv


def build_llm(engine_args: dict[str, Any]):
    """The one place the CLI builds an engine (imports torch)."""
    from vserve import LLM

    return LLM(**engine_args)
