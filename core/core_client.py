"""One message protocol between a front end and its EngineCore, two transports.

Front end -> core: ("add", [encoded child requests]), ("abort", [child request ids]), ("load_lora", (lora id,
name, path)), ("remove_lora", lora id), ("shutdown", None).
Core -> front end: ("step", StepOutputs, CoreStats) once per step (the new tokens as columns, core/messages.py);
("stats", CoreStats) when adds or aborts changed the cache while nothing runs; ("dead", reason) when the core
raised.

`CoreLoop` is the core's side of it: it applies the commands in arrival order and steps while there is work.
`InprocClient` runs it on the caller's thread (`recv()` steps the core: the CPU path and the server's
`--no-engine-process`); `ProcClient` runs it in an engine process of its own (`spawn`: CUDA-safe) and carries the
messages over two pipes, so the front end's detokenization and HTTP work overlap the device's step.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from vserve.core.config import EngineConfig
from vserve.core.messages import CoreInfo, decode_request
from vserve.ops import startup

if TYPE_CHECKING:
    from vserve.core.engine_core import EngineCore
    from vserve.core.processor import InputProcessor

log = logging.getLogger("vserve.engine")


class EngineStartError(RuntimeError):
    """The engine process failed to start on something other than bad input (its log has the traceback)."""


class CoreLoop:
    """The core's side of the protocol: `put` takes commands from any thread, `next_message` applies them and runs
    the next step (or waits for work)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._lock = threading.Lock()
        self._inbox: list[tuple] = []  # in arrival order: an abort and a new request reusing an id stay ordered
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.front_end_lost = False  # the engine process's front end died (no shutdown came)

    def put(self, command: tuple) -> None:
        with self._lock:
            self._inbox.append(command)
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def apply_commands(self) -> bool:
        """Apply the commands put so far (the loop does it before each step); whether there were any."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        core = self.core
        for kind, arg in inbox:
            if kind == "add":
                for child in arg:
                    core.add_request(decode_request(child))
            elif kind == "abort":
                core.abort_requests(arg)
            elif kind == "grammar_info":  # once, before the first structured request
                core.structured.set_tokenizer_info(*arg)
            elif kind == "forget_grammar":  # the front end dropped this compiled grammar
                core.structured.forget(arg)
            elif kind == "load_lora":
                core.load_lora(*arg)
            elif kind == "remove_lora":
                core.remove_lora(arg)
            else:  # shutdown
                self._stop.set()
        return bool(inbox)

    def next_message(self, block: bool = True) -> tuple | None:
        """The core's next message; None once stopped (or, without `block`, when there is nothing to do)."""
        core = self.core
        while not self._stop.is_set():
            took = self.apply_commands()
            if core.has_work():
                t0 = time.perf_counter()
                outputs = core.step()
                return "step", outputs, core.core_stats(time.perf_counter() - t0)
            if took:
                return "stats", core.core_stats(0.0)
            if not block:
                return None
            self._wake.wait(0.5)
            self._wake.clear()
        return None


class InprocClient:
    """The core in this process; `recv()` runs its next step on the calling thread."""

    def __init__(self, config: EngineConfig) -> None:
        from vserve.core.engine_core import EngineCore  # torch: only where the core runs

        self.core = EngineCore(config)
        self.info: CoreInfo = self.core.info()
        self.loop = CoreLoop(self.core)

    def send(self, command: tuple) -> None:
        self.loop.put(command)

    def recv(self, block: bool = True) -> tuple | None:
        """The core's next message (what the core raises propagates: the caller decides what a dead core means)."""
        return self.loop.next_message(block)

    def wake(self) -> None:
        """Return a blocked recv() (on shutdown)."""
        self.loop.stop()

    def is_alive(self) -> bool:
        return not self.loop.stopped

    def shutdown(self, timeout: float = 5.0) -> None:
        self.loop.stop()
        self.core.shutdown()


GC_THRESHOLD_0 = 50_000  # allocations between young collections (CPython's default: 700)


def tune_gc() -> None:
    """Once a process has started its engine half (front end or core): what start-up allocated (the model, the
    tokenizer, imported modules) moves out of the collector's view (gc.freeze), and young collections run every
    50,000 allocations instead of every 700. A run's per-token objects otherwise make the collector scan the whole
    heap over and over: 8.7% of an offline run's time at 256 requests (half with logprobs=5) on this project's CPU,
    0.4% after (docs/performance.md). A threshold the process set higher already is kept."""
    gc.collect()
    gc.freeze()
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(g0, GC_THRESHOLD_0), g1, g2)


# ---- the engine process ---------------------------------------------------------------------------------------
def _receive(loop: CoreLoop, commands) -> None:
    try:
        while True:
            cmd = commands.recv()
            loop.put(cmd)
            if cmd[0] == "shutdown":
                return
    except (EOFError, OSError):  # the front end's process is gone
        loop.front_end_lost = True
        loop.stop()


def run_engine_core(config: EngineConfig, commands, outputs) -> None:
    """The engine process's entry point: build the core, say ("ready", pid, start-up report, CoreInfo) or
    ("failed", kind, message), then step until told to stop or the front end is gone."""
    # The front end decides when the engine stops (a server after draining): a Ctrl-C or SIGTERM sent to the whole
    # group must not kill the engine under in-flight requests. A front end that dies closes the pipe, which stops us.
    from vserve.core.engine_core import EngineCore  # torch and the model code: counted as this process's imports

    startup.mark_imports()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        # On the CPU the engine keeps torch's thread count (every core, or OMP_NUM_THREADS): the front end's process
        # is mostly idle while the engine steps. Leaving it a core cost a third of the throughput on 2 cores
        # (SmolLM2 fp32, 32 streams of 256 tokens: 106 output tok/s with one thread, 129 and 148 with two,
        # against 135-149 offline; docs/performance.md).
        core = EngineCore(config)
    except ValueError as e:  # bad input (a model that does not fit, ...): the front end says it in one line
        outputs.send(("failed", "ValueError", str(e)))
        return
    except BaseException as e:
        log.error("the engine failed to start: %r", e, exc_info=e)
        outputs.send(("failed", type(e).__name__, str(e)))
        return
    tune_gc()
    outputs.send(("ready", os.getpid(), startup.report(), core.info()))
    loop = CoreLoop(core)
    threading.Thread(target=_receive, args=(loop, commands), name="vserve-engine-commands", daemon=True).start()
    code = 0
    try:
        while (msg := loop.next_message()) is not None:
            outputs.send(msg)
    except OSError:  # the front end is gone: nobody to serve
        pass
    except BaseException as e:  # the core is dead
        log.error("engine loop stopped: %r", e, exc_info=e)
        try:
            outputs.send(("dead", repr(e)))
        except OSError:
            pass
        code = 1
    finally:
        # a front end that died without saying shutdown crashed: other nodes' ranks see a failure, not a clean end
        core.shutdown(graceful=not loop.front_end_lost)
    sys.exit(code)


class ProcClient:
    """The core in an engine process. Started first, so the caller loads its tokenizer while the engine process
    imports torch and loads the weights; `wait_ready()` then waits for the model (minutes for a large one). Bad input
    at start-up comes back as the ValueError EngineCore raises in-process, anything else as EngineStartError."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._outputs, out_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_core, args=(config, cmd_recv, out_send), name="vserve-engine",
                                 daemon=True)  # daemon: ended at this process's exit, whatever happens
        self._send_lock = threading.Lock()
        self._closing = False
        self._proc.start()
        cmd_recv.close()  # ours closed, so the pipes report EOF when the other side dies
        out_send.close()
        self.pid = self._proc.pid
        self.info: CoreInfo | None = None

    def wait_ready(self) -> None:
        msg = None
        try:
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
            if msg[0] == "failed":
                self._proc.join(5)
                if msg[1] == "ValueError":
                    raise ValueError(msg[2])
                raise EngineStartError(f"the engine process failed to start: {msg[1]}: {msg[2]}")
        except BaseException:
            self.kill()
            raise
        startup.CHILD.update(msg[2])
        self.info = msg[3]
        log.info("engine process started (pid %d)", self.pid)

    def send(self, command: tuple) -> None:
        try:
            with self._send_lock:
                self._commands.send(command)
        except OSError:  # the engine process is gone: recv() reports it
            pass

    def recv(self, block: bool = True) -> tuple | None:
        """The engine's next message; ("dead", reason) once it is gone."""
        try:
            if not block and not self._outputs.poll():
                return None
            return self._outputs.recv()
        except (EOFError, OSError):
            pass
        if self._closing:
            return None
        self._proc.join(2)
        reason = f"the engine process died (exit code {self._proc.exitcode})"
        log.error("%s", reason)
        return "dead", reason

    def wake(self) -> None:
        """Nothing to do: shutdown() closes the pipe, which returns a blocked recv()."""

    def is_alive(self) -> bool:
        return not self._closing and self._proc.is_alive()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Tell the engine process to stop; kill it if it has not after `timeout` seconds."""
        self._closing = True
        self.send(("shutdown", None))
        self._proc.join(timeout)
        self.kill()
        self._commands.close()

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


def start_core(config: EngineConfig, serving: bool) -> tuple[InprocClient | ProcClient, InputProcessor, float | None]:
    """The core's client and this process's InputProcessor, and the seconds spent waiting for an engine process
    beyond this process's own loading (None: the core runs here). The engine process is spawned first, so this
    process loads its tokenizer while that one imports torch and loads the weights."""
    from vserve.core.processor import InputProcessor

    if not use_engine_process(config, serving):
        processor = InputProcessor.from_config(config)
        client = InprocClient(config)
        tune_gc()
        return client, processor, None
    start = time.perf_counter()
    client = ProcClient(config)
    try:
        processor = InputProcessor.from_config(config)
        own = time.perf_counter() - start
        client.wait_ready()
    except BaseException:
        client.kill()
        raise
    waited = time.perf_counter() - start - own
    tune_gc()
    return client, processor, waited


def use_engine_process(config: EngineConfig, serving: bool) -> bool:
    """Whether the core gets a process of its own: as asked, else for a server, and on a GPU (the text work then
    overlaps the device's step); on the CPU an offline run keeps it in-process (no spawn, no second model import).
    Under tensor/pipeline parallelism the core (rank 0) starts the other ranks wherever it runs."""
    if config.engine_process is not None:
        return config.engine_process
    if serving:
        return True
    return config.device == "cuda" or (config.device == "auto" and gpu_visible())


def gpu_visible() -> bool:
    """Whether this machine shows the process a GPU, asked of the driver's files rather than torch (whose import
    takes seconds that the engine process then spends again): an NVIDIA or AMD driver with a device, not hidden by
    CUDA_VISIBLE_DEVICES. Where the engine then finds no GPU after all, it runs on the CPU in its own process: the
    same outputs, only the transport differs."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", os.environ.get("HIP_VISIBLE_DEVICES"))
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    nvidia = "/proc/driver/nvidia/gpus"
    return (os.path.isdir(nvidia) and bool(os.listdir(nvidia))) or os.path.exists("/dev/kfd")
