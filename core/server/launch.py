"""Start the server: load the engine (in its own process, or on a thread) or the embedding engine, run uvicorn,
drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vserve.core.config import EngineConfig
from vserve.ops import startup

log = logging.getLogger("vserve.server")


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: tuple[str, ...] = ()  # the first is reported; none: the model as typed (a folder's name)
    chat_template: str | None = None  # a file path
    max_queue_len: int | None = None
    drain_timeout_s: float = 30.0
    log_interval_s: float = 10.0
    access_log: bool = True  # uvicorn's line per request (vLLM's --disable-uvicorn-access-log turns it off)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    lora_modules: tuple[str, ...] = ()  # name=path: LoRA adapters served from the start, selected by `model`
    lora_runtime_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    allow_special_tokens_in_content: bool = False
    task: str = "auto"  # auto | generate | embed (--task): what the model must serve


def build_server_app(config: EngineConfig, opts: ServeOptions):
    """(app, async engine or None): loads the model named by config, generative or embedding."""
    from vserve.core.server.app import ServerSettings, build_app

    template = None
    if opts.chat_template:
        p = Path(opts.chat_template)
        if not p.is_file():
            raise ValueError(f"--chat-template {opts.chat_template!r} is not a readable file")
        template = p.read_text()
    from vserve.core.hub import resolve_model_files

    names = served_model_names(config.model, opts.served_model_name)
    modules = parse_lora_modules(opts.lora_modules, names)
    if (modules or opts.lora_runtime_updating) and not config.enable_lora:
        raise ValueError(f"{'--lora-modules' if modules else '--enable-lora-runtime-updating'} needs --enable-lora")
    with startup.phase("resolve model"):
        config = resolve_model_files(config)  # here, so the engine process gets local paths
    embedder = engine = None
    embedding = bool(config.model) and _is_embedding(config.model)
    if opts.task != "auto" and (opts.task == "embed") != embedding:
        what = "an embedding model" if embedding else "a generative model (no embedding head)"
        raise ValueError(f"--task {opts.task}: {names[0]} is {what}; serve it with --task "
                         f"{'embed' if embedding else 'generate'} (or leave --task out)")
    if embedding:
        from vserve.core.embedding import EmbeddingEngine

        embedder = EmbeddingEngine(config.model, device="cpu" if config.device == "auto" else config.device)
    else:
        engine = _build_engine(config, opts)
        try:
            for name, path in modules:
                engine.add_lora_adapter(name, path)
        except BaseException:
            engine.shutdown(0.0)
            raise
    settings = ServerSettings(served_model_name=names[0], served_model_aliases=tuple(names[1:]),
                              api_key=opts.api_key, chat_template=template, log_interval_s=opts.log_interval_s,
                              enable_auto_tool_choice=opts.enable_auto_tool_choice,
                              tool_call_parser=opts.tool_call_parser, reasoning_parser=opts.reasoning_parser,
                              max_loras=config.max_loras if config.enable_lora else None,
                              lora_runtime_updating=opts.lora_runtime_updating,
                              allow_special_tokens_in_content=opts.allow_special_tokens_in_content)
    app = build_app(engine, settings, embedder=embedder)
    if engine is not None:
        metrics = app.state.metrics
        engine.on_step, engine.on_finish = metrics.on_step, metrics.on_finish
    return app, engine


def parse_lora_modules(given: tuple[str, ...], base_names: tuple[str, ...]) -> list[tuple[str, str]]:
    """--lora-modules' name=path pairs (ValueError naming a malformed or repeated one)."""
    pairs: list[tuple[str, str]] = []
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {item!r}")
        if name in base_names or any(name == n for n, _ in pairs):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice (or is the base model's)")
        pairs.append((name, path))
    return pairs


def served_model_names(model: str | None, given: tuple[str, ...]) -> tuple[str, ...]:
    """--served-model-name's names, else the hub id as typed, a local model's folder or file name, or the default
    model's name."""
    from vserve.core.hub import is_local
    from vserve.ops.assets import DEFAULT_MODEL_NAME

    if given:
        return given
    if model is None:
        return (DEFAULT_MODEL_NAME,)
    return (Path(model).name if is_local(model) else model,)


def _build_engine(config: EngineConfig, opts: ServeOptions):
    """The server's front end over an engine process (or, asked for or under TP/PP, a thread of this one)."""
    from vserve.core.async_engine import AsyncLLM

    return AsyncLLM(config, opts.max_queue_len)


def _is_embedding(model: str) -> bool:
    from vserve.core.model_config import is_embedding_model  # torch-free: the API process never imports torch

    p = Path(model)
    return p.is_dir() and is_embedding_model(p)


def _draining_server_class():
    import contextlib
    import signal
    import threading

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal (exit -15);
        an operator's SIGTERM is a clean stop here, so the process exits 0 instead."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return DrainingServer


def serve(config: EngineConfig, opts: ServeOptions) -> int:
    """Run until SIGTERM/SIGINT (drain, exit 0) or an engine crash (exit 1). Returns the exit status."""
    import uvicorn

    from vserve.core.core_client import EngineStartError

    _DrainingServer = _draining_server_class()
    try:
        app, engine = build_server_app(config, opts)
    except EngineStartError as e:  # the engine process logged the traceback
        log.error("%s", e)
        return 1
    # The engine loop (or the thread reading the engine process) and the event loop share the GIL. A thread
    # coming back from a CUDA wait or a socket write waits for the other to drop the GIL, by default after 5 ms:
    # longer than a decode step on a GPU.
    sys.setswitchinterval(0.0005)
    if engine is not None:
        engine.start()
    uv_config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level="info", access_log=opts.access_log,
                               timeout_graceful_shutdown=int(opts.drain_timeout_s))
    server = _DrainingServer(uv_config)
    failed = False

    async def watch_engine():
        nonlocal failed
        while engine is not None and not server.should_exit:
            if engine.error is not None:
                log.error("engine died: %r; shutting down", engine.error)
                failed = True
                server.should_exit = True
                return
            await asyncio.sleep(0.2)

    async def announce_ready():
        """uvicorn listens: the `server` phase ends, and `vserve bench startup` gets the start-up report."""
        start = time.perf_counter()
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.005)
        startup.PHASES["server"] = time.perf_counter() - start
        startup.write_report()

    async def main():
        asyncio.ensure_future(announce_ready())
        watcher = asyncio.ensure_future(watch_engine())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    try:
        asyncio.run(main())
    finally:
        if engine is not None:
            engine.shutdown()
    return 1 if failed else 0
