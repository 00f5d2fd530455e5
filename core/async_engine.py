"""AsyncLLM: the server's front end. asyncio streams per request over an EngineCore in its own process (the default)
or on a thread of this one (`--no-engine-process`, TP/PP), through the one protocol of core/core_client.py.

On the event loop: validation and tokenization (make_requests), the queue limit, aborts. On the reader thread: the
core's messages, detokenized by the OutputProcessor into deltas, handed to each request's stream in one wake-up per
step. With the thread transport the reader thread is the one that steps the core (torch releases the GIL in its
kernels, so HTTP handling goes on while a step runs).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from vserve.core.config import EngineConfig
from vserve.core.core_client import InprocClient, start_core
from vserve.core.lora.adapter import LoRARequest
from vserve.core.lora.registry import LoRARegistry, set_adapter
from vserve.core.messages import CoreStats, EngineStats, StepOutputs
from vserve.core.output_processor import OutputProcessor, RequestState
from vserve.core.processor import InputProcessor
from vserve.core.request import CompletionOutput, Request, RequestOutput
from vserve.core.sampling_params import SamplingParams

log = logging.getLogger("vserve.engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served."""


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queue-len allows."""


@dataclass
class _Stream:
    """One request's queue to its consumer. The engine sends deltas (what is new since the last step): `fold` adds
    each to the cumulative `output` (lists extended, text kept as pieces and joined once, at the end), then a
    streaming consumer gets the delta itself and a non-streaming one the finished output: no step copies what came
    before it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    final_only: bool = False  # a non-streaming request is woken once, with its final output
    children: list[Request] | None = None
    output: RequestOutput | None = None
    text_parts: list[list[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        first = self.children[0]
        with_lp = first.sampling_params.logprobs is not None
        self.output = RequestOutput(first.parent_id, first.prompt, first.prompt_token_ids,
                                    [CompletionOutput(r.index, "", [], 0.0 if with_lp else None,
                                                      [] if with_lp else None) for r in self.children], False)
        self.text_parts = [[] for _ in self.children]

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def fold(self, delta: RequestOutput) -> None:
        """On the event loop: add one delta to the output and wake the consumer if it wants this one."""
        out = self.output
        for d in delta.outputs:
            c = out.outputs[d.index]
            c.token_ids += d.token_ids
            self.text_parts[d.index].append(d.text)
            if d.logprobs is not None:
                c.logprobs += d.logprobs
                c.cumulative_logprob += d.cumulative_logprob or 0.0
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        out.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            out.finished = True
            for c, parts in zip(out.outputs, self.text_parts):
                c.text = "".join(parts)
        if not self.final_only:
            self.queue.put_nowait(delta)
        elif out.finished:
            self.queue.put_nowait(out)


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one (a consumer that fell behind gets them in one chunk)."""
    by_index = {c.index: c for c in a.outputs}
    outs = [by_index.pop(d.index).then(d) if d.index in by_index else d for d in b.outputs]
    outs += by_index.values()
    outs.sort(key=lambda c: c.index)
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids, outs, b.finished, b.num_cached_tokens,
                         a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)


def _fold(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, delta in items:
        stream.fold(delta)


def put_all(items: list[tuple[_Stream, object]], deliver: Callable[[list], None] = _fold) -> None:
    """Hand a step's outputs to their event loops: one wake-up per loop per step, not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        loop.call_soon_threadsafe(deliver, batch)


class EngineView:
    """What the event loop and metrics may read of the engine: its input processor (tokenizer, model config,
    limits; no weights) and the counters of the core's last message."""

    def __init__(self, processor: InputProcessor) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.model_config = processor.model_config
        self.max_model_len = processor.max_model_len
        self.make_requests = processor.make_requests
        self.update(CoreStats(EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0), 0, 0, 0, 0.0, 0))

    def update(self, stats: CoreStats) -> None:
        self._stats = stats.engine
        self.num_generated_tokens = stats.num_generated_tokens
        self.num_computed_prompt_tokens = stats.num_computed_prompt_tokens
        self.last_step_tokens = stats.last_step_tokens
        self.num_taken = stats.num_taken

    def stats(self) -> EngineStats:
        return self._stats


class AsyncLLM:
    """generate() / abort() streams over an EngineCore. With `engine_process` None the core gets its own process
    unless TP/PP ranks are involved (core_client.use_engine_process). The engine process is started first, so this
    process loads its tokenizer meanwhile. Bad input at start-up raises ValueError; an engine process that fails
    otherwise, EngineStartError."""

    def __init__(self, config: EngineConfig, max_queue_len: int | None = None,
                 on_step: Callable[[EngineView, int, float], None] | None = None,
                 on_finish: Callable[[RequestOutput, list[RequestState]], None] | None = None) -> None:
        from vserve.ops import startup

        self.max_queue_len = max_queue_len
        self.on_step = on_step
        self.on_finish = on_finish
        self._lock = threading.Lock()  # streams and output state: the event loop and the reader thread
        self._streams: dict[str, _Stream] = {}
        self.error: BaseException | None = None
        self._reason = ""
        self._closing = False
        self._num_sent = 0
        self.client, processor, waited = start_core(config, serving=True)
        if waited is not None:
            startup.PHASES["engine process"] = waited  # the wait beyond our own loading
            self.pid = self.client.pid
        else:
            self.pid = None
            log.info("engine loop on a thread of the server process")
        self.engine = EngineView(processor)
        self.loras = LoRARegistry.for_config(config, processor.model_config)
        self.output = OutputProcessor(processor.tokenizer)
        self._reader = threading.Thread(target=self._read, name="vserve-engine", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._closing = True
        self.client.wake()
        if self._reader.is_alive() and isinstance(self.client, InprocClient):
            self._reader.join(timeout)  # the core steps on it: let it finish the step before the ranks stop
        self.client.shutdown(timeout)

    @property
    def is_running(self) -> bool:
        return self.error is None and not self._closing and self.client.is_alive()

    def num_in_flight(self) -> int:
        return len(self._streams)

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(f"the engine stopped: {self._reason}")

    def _fail(self, error: BaseException, reason: str) -> None:
        """The engine is dead (any thread): tell every waiting client once."""
        self._reason = reason
        self.error = error
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.put(self._dead())

    # ---- requests (on the event loop) ---------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       stream: bool = True, cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """With `stream`, yield deltas (each output holds only the text, tokens and logprobs new since the one
        before) until finished; else one cumulative, finished output. Cancelling the iterator aborts the
        request."""
        if self.error is not None:
            raise self._dead()
        if params.structured_outputs is not None:  # a grammar compiles on a worker thread, off the event loop
            children = await asyncio.to_thread(self.engine.make_requests, request_id, prompt, params, cache_salt)
        else:
            children = self.engine.make_requests(request_id, prompt, params, cache_salt)  # ValueError: bad input
        set_adapter(children, self.loras.resolve(lora_request))
        s = _Stream(asyncio.get_running_loop(), asyncio.Queue(), final_only=not stream, children=children)
        with self._lock:
            num_waiting = self.engine.stats().num_waiting + self._num_sent - self.engine.num_taken
            if self.max_queue_len is not None and num_waiting >= self.max_queue_len:
                raise QueueFullError(f"the queue is full ({self.max_queue_len} waiting requests)")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.output.add(children)
            self._streams[request_id] = s
            self._num_sent += len(children)
        for command in self.engine.processor.core_commands(children):
            self.client.send(command)
        finished = False
        try:
            while True:
                item = await s.queue.get()
                # A consumer that fell behind gets the deltas waiting for it as one (the server then sends the
                # tokens of several steps in one chunk).
                while not isinstance(item, BaseException) and not item.finished and not s.queue.empty():
                    nxt = s.queue.get_nowait()
                    item = nxt if isinstance(nxt, BaseException) else merge_deltas(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def add_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Check an adapter folder and serve it under `name` (ValueError when bad: nothing is added)."""
        lr = self.loras.add(name, path)
        self.client.send(("load_lora", (lr.lora_int_id, lr.lora_name, lr.lora_path)))
        return lr

    def remove_lora_adapter(self, name: str) -> None:
        self.client.send(("remove_lora", self.loras.remove(name).lora_int_id))

    def abort(self, request_id: str) -> None:
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
            ids = self.output.abort(request_id) if known else []
        if ids:
            self.client.send(("abort", ids))

    # ---- the core's messages (on the reader thread) -----------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                msg = self.client.recv()
                if msg is None:  # shut down
                    return
                if msg[0] == "step":
                    self._on_step(msg[1], msg[2])
                elif msg[0] == "stats":
                    self.engine.update(msg[1])
                else:  # dead: the engine process logged the cause
                    self._fail(RuntimeError(f"the engine process stopped: {msg[1]}"), msg[1])
                    return
        except BaseException as e:  # an in-process core raised: the engine is dead
            log.error("engine loop stopped: %r", e, exc_info=e)
            self._fail(e, repr(e))

    def _on_step(self, core_outputs: StepOutputs, stats: CoreStats) -> None:
        self.engine.update(stats)
        if self.on_step is not None:
            self.on_step(self.engine, stats.last_step_tokens, stats.step_seconds)
        ready, finished = [], []
        with self._lock:
            outs, aborts = self.output.process(core_outputs, delta=True)
            for out in outs:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                    finished.append((out, self.output.last_finished[out.request_id]))
                if stream is not None:
                    ready.append((stream, out))
        if aborts:
            self.client.send(("abort", aborts))
        put_all(ready)
        if self.on_finish is not None:
            for out, states in finished:  # a finished delta lists every child's finish reason
                self.on_finish(out, states)
