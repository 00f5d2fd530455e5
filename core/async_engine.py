"""AsyncEngine: the LLMEngine step loop on its own thread, with asyncio streams for the server.

The loop thread owns the engine; the event loop only validates and tokenizes (make_requests), hands
requests over through a locked inbox and reads outputs from per-request asyncio queues. torch releases the
GIL in its kernels, so HTTP handling goes on while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from vserve.core.engine import LLMEngine
from vserve.core.request import Request, RequestOutput
from vserve.core.sampling_params import SamplingParams

log = logging.getLogger("vserve.engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served."""


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queue-len allows."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    final_only: bool = False  # a non-streaming request is woken once, with its final output

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _deliver(items: list[tuple[_Stream, object]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _put_all(items: list[tuple[_Stream, object]]) -> None:
    """Hand a step's outputs to their event loops: one wake-up per loop per step, not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        loop.call_soon_threadsafe(_deliver, batch)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None,
                 on_step: Callable[[LLMEngine, int, float], None] | None = None,
                 on_finish: Callable[[RequestOutput, list[Request]], None] | None = None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.on_step = on_step
        self.on_finish = on_finish
        self._lock = threading.Lock()
        self._inbox: list[list[Request]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vserve-engine", daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stop.is_set()

    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests -----------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs until finished (only the final one unless `stream`); cancelling the
        iterator aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        children = self.engine.make_requests(request_id, prompt, params)  # ValueError for bad input
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), final_only=not stream)
        with self._lock:
            if self.max_queue_len is not None and len(self.engine.scheduler.waiting) + len(self._inbox) \
                    >= self.max_queue_len:
                raise QueueFullError(f"the queue is full ({self.max_queue_len} waiting requests)")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._inbox.append(children)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # Outputs are cumulative: when the consumer has fallen behind, only the latest one matters
                # (the server then sends the tokens of several steps in one chunk).
                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is not None:
                self._aborts.append(request_id)
        self._wake.set()

    # ---- the loop thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for children in inbox:
                    if children[0].parent_id in aborts:
                        continue
                    engine.submit(children)
                for rid in aborts:
                    engine.abort_request(rid)
                if not engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                with self._lock:
                    finished_only = all(s.final_only for s in self._streams.values())
                outputs = engine.step(finished_only=finished_only)
                if self.on_step is not None:
                    self.on_step(engine, engine.last_step_tokens, time.perf_counter() - t0)
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
                _put_all(ready)
        except BaseException as e:  # the engine is dead: tell every waiting client once
            self.error = e
            log.error("engine loop stopped: %r", e, exc_info=e)
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for s in streams:
                s.put(e)
