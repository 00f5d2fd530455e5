"""`vserve serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import logging
import os
from typing import Any

import typer
from rich.console import Console

from vserve.cli.engine_args import engine_command, print_config

console = Console(stderr=True, highlight=False)
# the names of core/tool_parsers.py's and core/reasoning_parsers.py's parsers (cli/ imports no core at start-up)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# --task (vLLM's names, the seeds' "completion" and vLLM's older "embedding" too) -> what is served
TASKS = {"auto": "auto", "generate": "generate", "completion": "generate", "embed": "embed", "embedding": "embed"}


@engine_command
def serve(
    model_arg: str | None = typer.Argument(None, metavar="[MODEL]", help="HF folder, .gguf or hub id (org/name, "
                                           "org/name:QUANT); none: $VSERVE_MODEL, else the embedded default (an "
                                           "embedding model serves /v1/embeddings)"),
    host: str = typer.Option("127.0.0.1", help="Address to bind (127.0.0.1 unless told)"),
    port: int = typer.Option(8000, help="Port to listen on"),
    api_key: str | None = typer.Option(None, help="Require 'Authorization: Bearer KEY' on /v1 and /tokenize "
                                       "routes (default: $VSERVE_API_KEY)"),
    served_model_name: list[str] | None = typer.Option(None, help="Model name clients use; repeat it for more names "
                                                       "(the first is reported; default: the hub id as typed, or "
                                                       "the folder's name)"),
    chat_template: str | None = typer.Option(None, help="Jinja chat template file overriding the model's"),
    max_queue_len: int | None = typer.Option(None, help="Most waiting requests before 429"),
    drain_timeout: float = typer.Option(30.0, help="Seconds to finish in-flight requests after SIGTERM"),
    disable_uvicorn_access_log: bool = typer.Option(False, "--disable-uvicorn-access-log",
                                                    help="No log line per HTTP request"),
    enable_auto_tool_choice: bool = typer.Option(False, "--enable-auto-tool-choice",
                                                 help='tool_choice "auto": parse calls with --tool-call-parser'),
    tool_call_parser: str | None = typer.Option(None, help="hermes (Qwen2.5/3), llama3_json (Llama 3.1+), mistral, "
                                                "pythonic (Llama 3.2/4)"),
    reasoning_parser: str | None = typer.Option(None, help="deepseek_r1 or qwen3: <think>...</think> goes to the "
                                                "message's reasoning field"),
    lora_modules: list[str] | None = typer.Option(None, help="LoRA adapter NAME=PATH served from the start (needs "
                                                  "--enable-lora); repeat it for more; a request picks one by "
                                                  "its `model`"),
    enable_lora_runtime_updating: bool = typer.Option(False, "--enable-lora-runtime-updating",
                                                      help="Serve POST /v1/load_lora_adapter and "
                                                      "/v1/unload_lora_adapter (else 404)"),
    task: str = typer.Option("auto", help="auto | generate | completion | embed: what the model serves (vLLM's "
                             "--task; completion is generate); a model that cannot do it is an error"),
    awq_algorithm: str | None = typer.Option(None, hidden=True, help="Not a flag: kernels are chosen automatically"),
    allow_special_tokens_in_content: bool = typer.Option(
        False, "--allow-special-tokens-in-content", help="Let user and tool message content tokenize to special "
        "tokens (by default their special-token strings are neutralised, so a message cannot inject a turn)"),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Serve a model over an OpenAI-compatible API (completions, chat, embeddings, metrics)."""
    from vserve.core.config import EngineConfig

    if model_arg is None and engine_args.get("model") is None:
        model_arg = os.environ.get("VSERVE_MODEL") or None  # a container's baked-in model (Dockerfile)
    if model_arg is not None:
        if engine_args.get("model") is not None and engine_args["model"] != model_arg:
            raise ValueError("give the model once: as MODEL or as --model")
        engine_args["model"] = model_arg
    if awq_algorithm is not None:
        raise ValueError(f"--awq-algorithm {awq_algorithm} is not a flag: the AWQ kernel is chosen automatically "
                         "(W4A16 Triton GEMM on GPUs, dequantized weights on CPU); drop it and keep --quantization awq")
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    if max_queue_len is not None and max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {max_queue_len}")
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    for flag, value, names in (("--tool-call-parser", tool_call_parser, TOOL_CALL_PARSERS),
                               ("--reasoning-parser", reasoning_parser, REASONING_PARSERS)):
        if value is not None and value not in names:
            raise ValueError(f"{flag} must be one of {', '.join(names)}, got {value!r}")
    key = api_key or os.environ.get("VSERVE_API_KEY") or None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    from vserve.core.server.launch import ServeOptions
    from vserve.core.server.launch import serve as run

    config = EngineConfig.resolve(engine_args)
    print_config(config)
    opts = ServeOptions(host=host, port=port, api_key=key, served_model_name=tuple(served_model_name or ()),
                        chat_template=chat_template, max_queue_len=max_queue_len, drain_timeout_s=drain_timeout,
                        access_log=not disable_uvicorn_access_log, enable_auto_tool_choice=enable_auto_tool_choice,
                        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                        lora_modules=tuple(lora_modules or ()),
                        lora_runtime_updating=enable_lora_runtime_updating,
                        allow_special_tokens_in_content=allow_special_tokens_in_content, task=TASKS[task])
    console.print(f"vserve serving on http://{host}:{port}/v1 (api key {'required' if key else 'off'})")
    raise typer.Exit(run(config, opts))
