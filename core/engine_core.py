"""The engine in its own process (vLLM V1's EngineCore behind AsyncLLM): the server's process only does HTTP,
validation, tokenization and SSE; the engine process only steps.

Two one-way pipes of pickled builtins. Server -> engine: ("add", (children, stream)), ("abort", id),
("shutdown", None). Engine -> server, one message per step: ("step", deltas, stats), where a delta holds only
what is new for a request since its last one (token ids, text, logprobs, finish state), so the bytes sent grow
with the tokens, not with their square; ("stats", stats) when aborts or adds changed the cache while idle;
("dead", reason) when the loop raised. On the server's event loop each delta goes to its request's stream
(core/async_engine.py `_Stream.fold`): a streaming response gets the delta, a non-streaming one the output built
from them once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from vserve.core.async_engine import EngineClient, StepLoop, _Stream, put_all
from vserve.core.config import EngineConfig
from vserve.core.engine import EngineStats
from vserve.core.processor import InputProcessor
from vserve.core.request import CompletionOutput, Request, RequestOutput
from vserve.ops import startup

log = logging.getLogger("vserve.engine")


@dataclass(slots=True)
class CoreStats:
    """What one engine-process message says of the engine: EngineStats plus the counters metrics read."""

    engine: EngineStats
    num_generated_tokens: int
    num_computed_prompt_tokens: int
    last_step_tokens: int
    step_seconds: float
    num_taken: int  # requests the loop has taken from its inbox


def _encode(req: Request) -> tuple:
    return (req.request_id, req.prompt_token_ids, req.sampling_params, req.max_tokens, req.parent_id, req.index,
            req.eos_token_id, req.arrival_time, req.cache_salt)


def _decode(t: tuple) -> Request:
    rid, ids, sp, max_tokens, parent_id, index, eos, arrival, salt = t
    return Request(request_id=rid, prompt_token_ids=ids, sampling_params=sp, max_tokens=max_tokens,
                   parent_id=parent_id, index=index, eos_token_id=eos, arrival_time=arrival, cache_salt=salt)


# ---- the engine process -----------------------------------------------------------------------------------------
class EngineCore:
    """The engine process's side: commands in (a receiving thread), the StepLoop on the main thread."""

    def __init__(self, engine, commands, outputs) -> None:
        self.engine, self.commands, self.outputs = engine, commands, outputs
        self.loop = StepLoop(engine, self._emit, delta=True, on_idle=lambda: self._send(("stats", self._stats(0.0))))

    def _receive(self) -> None:
        try:
            while True:
                kind, arg = self.commands.recv()
                if kind == "add":
                    children, stream = arg
                    self.loop.add([_decode(c) for c in children], stream)
                elif kind == "abort":
                    self.loop.abort(arg)
                else:  # shutdown
                    break
        except (EOFError, OSError):  # the server process is gone
            pass
        self.loop.stop()

    def _send(self, msg) -> None:
        try:
            self.outputs.send(msg)
        except OSError:  # the server process is gone: nobody to serve
            self.loop.stop()

    def _stats(self, seconds: float) -> CoreStats:
        e = self.engine
        return CoreStats(e.stats(), e.num_generated_tokens, e.num_computed_prompt_tokens,
                         e.last_step_tokens, seconds, self.loop.num_taken)

    def _emit(self, outputs: list[RequestOutput], seconds: float) -> None:
        finished = self.engine.last_finished
        deltas = []
        for out in outputs:
            times = [(r.first_token_time, r.scheduled_time) for r in finished[out.request_id]] \
                if out.finished else None
            deltas.append((out.request_id, out.num_cached_tokens, times,
                           [(c.index, c.token_ids, c.text, c.logprobs, c.cumulative_logprob, c.finish_reason,
                             c.stop_reason) for c in out.outputs]))
        self._send(("step", deltas, self._stats(seconds)))

    def run(self) -> int:
        threading.Thread(target=self._receive, name="vserve-engine-commands", daemon=True).start()
        try:
            self.loop.run()
            return 0
        except BaseException as e:  # the engine is dead
            log.error("engine loop stopped: %r", e, exc_info=e)
            self._send(("dead", repr(e)))
            return 1
        finally:
            self.engine.shutdown()


def run_engine_core(config: EngineConfig, commands, outputs) -> None:
    """The engine process's entry point: build the engine, say ("ready", pid, start-up report) or ("failed", kind,
    message), then step until told to stop or the server is gone."""
    # The server decides when the engine stops (after draining): a Ctrl-C or SIGTERM sent to the whole group
    # must not kill the engine under in-flight requests. A server that dies closes the pipe, which stops us.
    startup.mark_imports()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    from vserve.core.engine import LLMEngine

    try:
        # On the CPU the engine keeps torch's thread count (every core, or OMP_NUM_THREADS): the server's process is
        # mostly idle while the engine steps. Leaving it a core cost a third of the throughput on 2 cores
        # (SmolLM2 fp32, 32 streams of 256 tokens: 106 output tok/s with one thread, 129 and 148 with two,
        # against 135-149 offline; docs/performance.md).
        engine = LLMEngine(config)
    except ValueError as e:  # bad input (a model that does not fit, ...): the server says it in one line
        outputs.send(("failed", "ValueError", str(e)))
        return
    except BaseException as e:
        log.error("the engine failed to start: %r", e, exc_info=e)
        outputs.send(("failed", type(e).__name__, str(e)))
        return
    outputs.send(("ready", os.getpid(), startup.report()))
    sys.exit(EngineCore(engine, commands, outputs).run())


# ---- the server process -----------------------------------------------------------------------------------------
class EngineStartError(RuntimeError):
    """The engine process failed to start on something other than bad input (its log has the traceback)."""


class RemoteEngine:
    """The server's view of the engine in the other process: its input processor (tokenizer, model config,
    limits; no weights) and the counters of the engine's last message, for metrics and the queue limit."""

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


class EngineCoreClient(EngineClient):
    """AsyncEngine's surface over an engine process: starts it (`spawn`: CUDA-safe), loads the tokenizer meanwhile,
    and waits until the model is loaded; bad input at start-up comes back as the ValueError LLMEngine raises
    in-process, anything else as EngineStartError."""

    def __init__(self, config: EngineConfig, max_queue_len: int | None = None, on_step=None,
                 on_finish=None) -> None:
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._outputs, out_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_core, args=(config, cmd_recv, out_send), name="vserve-engine",
                                 daemon=True)  # daemon: ended at this process's exit, whatever happens
        self._send_lock = threading.Lock()
        self._num_sent = 0
        self._closing = False
        start = time.perf_counter()
        # The engine process first: it imports torch and loads the weights while this process loads the tokenizer.
        self._proc.start()
        cmd_recv.close()  # ours closed, so the pipes report EOF when the other side dies
        out_send.close()
        try:
            super().__init__(RemoteEngine(InputProcessor.from_config(config)), max_queue_len, on_step, on_finish)
            own = time.perf_counter() - start
            self._wait_ready()
        except BaseException:
            self._kill()
            raise
        startup.PHASES["engine process"] = time.perf_counter() - start - own  # the wait beyond our own loading
        self.pid = self._proc.pid
        log.info("engine process started (pid %d)", self.pid)
        self._reader = threading.Thread(target=self._read, name="vserve-engine-outputs", daemon=True)

    def _wait_ready(self) -> None:
        """Until the engine is built (loading a large model takes minutes) or its process fails."""
        msg = None
        while msg is None:
            if self._outputs.poll(0.2):
                try:
                    msg = self._outputs.recv()
                except EOFError:
                    break
            elif not self._proc.is_alive():
                break
        if msg is None:
            self._proc.join(5)
            raise EngineStartError(f"the engine process exited with code {self._proc.exitcode} while starting")
        if msg[0] == "ready":
            startup.CHILD.update(msg[2])
        if msg[0] == "failed":
            self._proc.join(5)
            if msg[1] == "ValueError":
                raise ValueError(msg[2])
            raise EngineStartError(f"the engine process failed to start: {msg[1]}: {msg[2]}")

    def start(self) -> None:
        self._reader.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Tell the engine process to stop; kill it if it has not after `timeout` seconds."""
        self._closing = True
        self._send(("shutdown", None))
        self._proc.join(timeout)
        self._kill()
        self._commands.close()

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    @property
    def is_running(self) -> bool:
        return self.error is None and not self._closing and self._proc.is_alive()

    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self._commands.send(msg)
        except OSError:  # the engine process is gone: the reader reports it
            pass

    # ---- EngineClient ---------------------------------------------------------------------------------------
    def _num_waiting(self) -> int:
        return self.engine.stats().num_waiting + self._num_sent - self.engine.num_taken

    def _submit(self, children: list[Request], stream: _Stream) -> None:
        self._num_sent += 1
        self._send(("add", ([_encode(r) for r in children], not stream.final_only)))

    def _abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    # ---- the engine's messages ------------------------------------------------------------------------------
    def _read(self) -> None:
        """The reader thread: the engine's messages, in order, until it stops or dies."""
        try:
            while True:
                msg = self._outputs.recv()
                if msg[0] == "step":
                    self._on_step(msg[1], msg[2])
                elif msg[0] == "stats":
                    self.engine.update(msg[1])
                else:  # dead: the engine process logged the cause
                    self._fail(RuntimeError(f"the engine process stopped: {msg[1]}"), msg[1])
                    return
        except (EOFError, OSError):
            pass
        if not self._closing:
            self._proc.join(2)
            reason = f"the engine process died (exit code {self._proc.exitcode})"
            log.error("%s", reason)
            self._fail(RuntimeError(reason), reason)

    def _on_step(self, deltas: list[tuple], stats: CoreStats) -> None:
        self.engine.update(stats)
        if self.on_step is not None:
            self.on_step(self.engine, stats.last_step_tokens, stats.step_seconds)
        ready = []
        with self._lock:
            for d in deltas:
                stream = self._streams.get(d[0])
                if stream is None:  # aborted meanwhile
                    continue
                if d[2] is not None:
                    del self._streams[d[0]]
                ready.append((stream, d))
        put_all(ready, self._apply)

    def _apply(self, batch: list[tuple[_Stream, tuple]]) -> None:
        """On the stream's event loop: each message's delta to its stream (which folds it into the request's
        output and wakes its consumer)."""
        for stream, (request_id, num_cached, times, comps) in batch:
            out = stream.output
            delta = RequestOutput(request_id, out.prompt, out.prompt_token_ids,
                                  [CompletionOutput(index, text, token_ids, cum_lp, lps, finish_reason, stop_reason)
                                   for index, token_ids, text, lps, cum_lp, finish_reason, stop_reason in comps],
                                  times is not None, num_cached)
            stream.fold(delta)
            if times is not None and self.on_finish is not None:
                for req, comp, (first_token_time, scheduled_time) in zip(stream.children, out.outputs, times):
                    req.first_token_time, req.scheduled_time = first_token_time, scheduled_time
                    req.output_token_ids = comp.token_ids
                self.on_finish(out, stream.children)
