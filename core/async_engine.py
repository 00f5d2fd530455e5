"""The server's engine clients: asyncio streams per request over an LLMEngine step loop.

`EngineClient` holds what both kinds share: the streams, validation and tokenization on the event loop
(make_requests), the queue limit, aborts and engine-death propagation. `AsyncEngine` runs the `StepLoop` on a
thread of the server process (torch releases the GIL in its kernels, so HTTP handling goes on while a step
runs); `EngineCoreClient` (core/engine_core.py) runs it in a process of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from vserve.core.engine import LLMEngine
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
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids, outs, b.finished, b.num_cached_tokens)


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


class StepLoop:
    """The step loop over an LLMEngine, fed through a locked inbox; `emit` gets each step's outputs.

    AsyncEngine's thread and the engine process's main thread both run it. When no request streams, the
    engine makes outputs only for finished requests."""

    def __init__(self, engine: LLMEngine, emit: Callable[[list[RequestOutput], float], None], delta: bool = False,
                 on_idle: Callable[[], None] | None = None) -> None:
        self.engine, self.emit, self.delta, self.on_idle = engine, emit, delta, on_idle
        self._lock = threading.Lock()
        # Adds and aborts in arrival order: an abort and a new request reusing its id can arrive between two
        # passes, and the abort must reach the old request only.
        self._inbox: list[tuple[list[Request], bool] | str] = []
        self._streaming: set[str] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.num_taken = 0  # requests taken from the inbox

    def add(self, children: list[Request], stream: bool) -> None:
        with self._lock:
            self._inbox.append((children, stream))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(request_id)
        self._wake.set()

    def num_pending(self) -> int:
        """Requests added but not yet taken."""
        with self._lock:
            return sum(not isinstance(item, str) for item in self._inbox)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Until stop(); whatever the engine raises propagates."""
        engine = self.engine
        while not self._stop.is_set():
            with self._lock:
                inbox, self._inbox = self._inbox, []
            for item in inbox:
                if isinstance(item, str):  # an abort
                    engine.abort_request(item)
                    self._streaming.discard(item)
                    continue
                children, stream = item
                self.num_taken += 1
                engine.submit(children)
                if stream:
                    self._streaming.add(children[0].parent_id)
            if not engine.has_unfinished_requests():
                if inbox and self.on_idle is not None:
                    self.on_idle()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            outputs = engine.step(finished_only=not self._streaming, delta=self.delta)
            for out in outputs:
                if out.finished:
                    self._streaming.discard(out.request_id)
            self.emit(outputs, time.perf_counter() - t0)


class EngineClient:
    """generate() / abort() streams over an engine that runs elsewhere (a thread, a process).

    `engine` is what the event loop may use directly: make_requests, tokenizer, model_config, max_model_len,
    stats() and the token counters (the LLMEngine itself, or the engine process's RemoteEngine)."""

    def __init__(self, engine, max_queue_len: int | None = None,
                 on_step: Callable[[object, int, float], None] | None = None,
                 on_finish: Callable[[RequestOutput, list[Request]], None] | None = None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.on_step = on_step
        self.on_finish = on_finish
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self.error: BaseException | None = None
        self._reason = ""

    # ---- what a kind of client provides -------------------------------------------------------------------
    def _num_waiting(self) -> int:
        raise NotImplementedError

    def _submit(self, children: list[Request], stream: _Stream) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------------------
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

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       stream: bool = True, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """With `stream`, yield deltas (each output holds only the text, tokens and logprobs new since the one
        before) until finished; else one cumulative, finished output. Cancelling the iterator aborts the
        request."""
        if self.error is not None:
            raise self._dead()
        children = self.engine.make_requests(request_id, prompt, params, cache_salt)  # ValueError for bad input
        s = _Stream(asyncio.get_running_loop(), asyncio.Queue(), final_only=not stream, children=children)
        with self._lock:
            if self.max_queue_len is not None and self._num_waiting() >= self.max_queue_len:
                raise QueueFullError(f"the queue is full ({self.max_queue_len} waiting requests)")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = s
        self._submit(children, s)
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

    def abort(self, request_id: str) -> None:
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            self._abort(request_id)


class AsyncEngine(EngineClient):
    """The step loop on a thread of this process (`vserve serve --no-engine-process`, and under TP/PP)."""

    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None,
                 on_step: Callable[[LLMEngine, int, float], None] | None = None,
                 on_finish: Callable[[RequestOutput, list[Request]], None] | None = None) -> None:
        super().__init__(engine, max_queue_len, on_step, on_finish)
        self.loop = StepLoop(engine, self._emit, delta=True)
        self._thread = threading.Thread(target=self._run, name="vserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self.loop.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self.loop.stopped

    def _num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self.loop.num_pending()

    def _submit(self, children: list[Request], stream: _Stream) -> None:
        self.loop.add(children, not stream.final_only)

    def _abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as e:  # the engine is dead
            log.error("engine loop stopped: %r", e, exc_info=e)
            self._fail(e, repr(e))

    def _emit(self, outputs: list[RequestOutput], seconds: float) -> None:
        engine = self.engine
        if self.on_step is not None:
            self.on_step(engine, engine.last_step_tokens, seconds)
        ready = []
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if out.finished and self.on_finish is not None:
                self.on_finish(out, engine.last_finished.get(out.request_id, []))
            if stream is not None and (out.finished or not stream.final_only):
                ready.append((stream, out))
        put_all(ready)
