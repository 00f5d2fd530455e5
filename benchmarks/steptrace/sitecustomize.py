"""A step timeline of every vserve engine in any process started with this folder on PYTHONPATH.

    VSERVE_STEP_TRACE_DIR=DIR PYTHONPATH=benchmarks/steptrace:... python benchmarks/h200_bench.py ...

Python imports `sitecustomize` at start-up, so the server, its engine process (spawned) and the benchmark's own
offline engine are all traced without a change to vserve: each process appends JSON lines to DIR/trace-PID.jsonl,
one per engine step (start, end, seconds waiting for the device's tokens, seconds in the runner's launch, tokens
scheduled, requests running/waiting, outputs made), one per message the server's reader
applies, one per request the server's front end takes in, one per streamed completion (handler start, first and last
chunk) and one per `bench serve` request (sent, first token, end). benchmarks/steptrace/analyze.py summarizes the
files. Only for benchmarking: it adds ~20 us per step.
"""

import atexit
import json
import os
import time

_DIR = os.environ.get("VSERVE_STEP_TRACE_DIR")


def _install() -> None:
    import importlib.abc
    import sys

    state = {"wait": 0.0, "launch": 0.0, "lines": []}
    path = os.path.join(_DIR, f"trace-{os.getpid()}.jsonl")

    def flush() -> None:
        if state["lines"]:
            with open(path, "a") as fh:
                fh.write("".join(state["lines"]))
            state["lines"] = []

    def record(**kw) -> None:
        state["lines"].append(json.dumps(kw) + "\n")
        if len(state["lines"]) >= 200:
            flush()

    atexit.register(flush)

    def add_time(cls, name: str, key: str) -> None:
        """cls.name's seconds added up into state[key] (reset by each step)."""
        orig = getattr(cls, name)

        def timed(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig(self, *a, **k)
            finally:
                state[key] += time.perf_counter() - t0
        setattr(cls, name, timed)

    def record_call(cls, name: str, kind: str) -> None:
        """One `kind` line per call of cls.name(self, items, ...): its start, end and len(items)."""
        orig = getattr(cls, name)

        def timed(self, items, *a):
            t0 = time.perf_counter()
            orig(self, items, *a)
            record(k=kind, t0=t0, t1=time.perf_counter(), n=len(items))
        setattr(cls, name, timed)

    def patch_sampler(mod) -> None:
        add_time(mod.SampledTokens, "resolve", "wait")

    def patch_runner(mod) -> None:
        add_time(mod.ModelRunner, "launch", "launch")

    def patch_core(mod) -> None:
        orig = mod.EngineCore.step

        def step(self):
            state["wait"] = state["launch"] = 0.0
            t0 = time.perf_counter()
            outs = orig(self)
            t1 = time.perf_counter()
            s = self.scheduler
            record(k="step", t0=t0, t1=t1, wait=state["wait"], launch=state["launch"],
                   tokens=self.last_step_tokens, running=len(s.running), waiting=len(s.waiting), outs=len(outs))
            if len(state["lines"]) == 1 or not s.running:
                flush()
            return outs
        mod.EngineCore.step = step

    def patch_front(mod) -> None:
        record_call(mod.AsyncLLM, "_on_step", "recv")
        orig_generate = mod.AsyncLLM.generate

        def generate(self, *a, **k):
            record(k="add", t=time.perf_counter())
            return orig_generate(self, *a, **k)
        mod.AsyncLLM.generate = generate

    def patch_serving(mod) -> None:
        orig = mod._stream_completion

        async def _stream_completion(*a, **k):
            t_in, first = time.perf_counter(), None
            async for chunk in orig(*a, **k):
                if first is None:
                    first = time.perf_counter()
                yield chunk
            record(k="http", t_in=t_in, first=first, last=time.perf_counter())
        mod._stream_completion = _stream_completion

    def patch_client(mod) -> None:
        orig = mod.send_request

        async def send_request(*a, **k):
            sent = time.perf_counter()
            out = await orig(*a, **k)
            record(k="req", sent=sent, first=sent + out.ttft if out.ttft else None, end=time.perf_counter())
            return out
        mod.send_request = send_request

    patches = {"vserve.core.server.serving": patch_serving, "vserve.cli.bench_serve": patch_client,
               "vserve.core.sampler": patch_sampler, "vserve.core.model_runner": patch_runner,
               "vserve.core.engine_core": patch_core, "vserve.core.async_engine": patch_front}

    class Finder(importlib.abc.MetaPathFinder):
        """Patches each module right after its first import."""

        def find_spec(self, name, path=None, target=None):
            if name not in patches:
                return None
            sys.meta_path.remove(self)
            try:
                import importlib.util
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None:
                return None
            loader, fix = spec.loader, patches[name]

            class Loader(importlib.abc.Loader):
                def create_module(self, spec):
                    return loader.create_module(spec)

                def exec_module(self, module):
                    loader.exec_module(module)
                    fix(module)
            spec.loader = Loader()
            return spec

    sys.meta_path.insert(0, Finder())


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    _install()
