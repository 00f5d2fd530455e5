"""Prometheus metrics with vLLM's names under `vserve:`, labelled by model_name, and the periodic log line; beside
them the names the seeds use (`vserve:num_requests`, `vserve:cache_hit_rate`, ...; `seed_values`), which
`LLM.get_metrics()` also gives offline."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vserve.core.request import RequestOutput

# The seeds' gauge names (seed 001: /metrics; seed 003: LLM.get_metrics()), what each reads, and its help.
SEED_GAUGES = {
    "num_requests": "Requests in the engine (running + waiting).",
    "running_requests": "Requests in the running batch (vserve:num_requests_running).",
    "num_generation_tokens": "Tokens generated so far (vserve:generation_tokens_total).",
    "decode_tokens": "Tokens generated so far (decode steps' tokens).",
    "prefill_tokens": "Prompt tokens computed so far (prefix cache hits excluded).",
    "cache_hit_rate": "Prefix cache hits / queries, in tokens, since start (0-1).",
    "block_utilization": "Fraction of KV cache blocks in use (vserve:kv_cache_usage_perc).",
    "gpu_utilization": "The GPU's busy fraction over NVML's last sample period (0-1); 0 without an NVIDIA GPU.",
    "memory_utilization": "Device memory in use / total (0-1): the GPU's through NVML, else the host's RAM.",
}


def device_utilization() -> tuple[float, float]:
    """(gpu_utilization, memory_utilization) of GPU 0 through NVML (no CUDA context is made), else (0.0, the host's
    used RAM fraction)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        return pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0, mem.used / mem.total
    except Exception:  # no driver, no GPU, no library: a CPU host
        pass
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0])
        return 0.0, 1.0 - info["MemAvailable"] / info["MemTotal"]
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return 0.0, 0.0


def seed_values(engine) -> dict[str, float]:
    """The seeds' gauges of an engine (LLMEngine or the server's EngineView): SEED_GAUGES' names -> values."""
    s = engine.stats()
    gpu, mem = device_utilization()
    return {
        "num_requests": float(s.num_running + s.num_waiting),
        "running_requests": float(s.num_running),
        "num_generation_tokens": float(engine.num_generated_tokens),
        "decode_tokens": float(engine.num_generated_tokens),
        "prefill_tokens": float(engine.num_computed_prompt_tokens),
        "cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
        "block_utilization": float(s.kv_cache_usage),
        "gpu_utilization": gpu,
        "memory_utilization": mem,
    }

log = logging.getLogger("vserve.metrics")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineMetrics:
    def __init__(self, model_name: str, max_loras: int | None = None) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.model_name = model_name

        def g(name, doc):
            return Gauge(f"vserve:{name}", doc, lab, registry=r).labels(model_name)

        def c(name, doc):
            return Counter(f"vserve:{name}", doc, lab, registry=r).labels(model_name)

        def h(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(f"vserve:{name}", doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = g("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = g("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = g("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.prefix_cache_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = c("num_preemptions", "Requests preempted (to be recomputed).")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens computed (prefill).")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self._success = Counter("vserve:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.time_to_first_token = h("time_to_first_token_seconds", "Time to first token.")
        self.time_per_output_token = h("time_per_output_token_seconds", "Time per output token after the first.")
        self.e2e_request_latency = h("e2e_request_latency_seconds", "End-to-end request latency.")
        self.request_queue_time = h("request_queue_time_seconds", "Time from arrival to first scheduling.")
        self.iteration_tokens = h("iteration_tokens_total", "Tokens computed per engine step.", _TOKEN_BUCKETS)
        self.structured_output_requests = c("structured_output_requests", "Requests with a structured output.")
        self.grammar_compile_time = h("structured_output_compile_seconds",
                                      "Grammar compile time (cache misses; xgrammar).")
        self._seen = {"queries": 0, "hits": 0, "preemptions": 0, "prompt": 0, "gen": 0, "structured": 0}
        self.max_loras = max_loras
        self.lora_info = None if max_loras is None else Gauge(
            "vserve:lora_requests_info", "Running and waiting LoRA adapters (comma-separated); the value is when "
            "this was last set.", ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self._lora_seen: tuple | None = None
        self.seed_gauges = {name: g(name, doc) for name, doc in SEED_GAUGES.items()}
        self._log_mark = (time.monotonic(), 0, 0)

    def on_step(self, engine, step_tokens: int, _seconds: float) -> None:
        s = engine.stats()
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.kv_cache_usage_perc.set(s.kv_cache_usage)
        self._set_lora(s)
        self._inc("queries", self.prefix_cache_queries, s.prefix_cache_queries)
        self._inc("hits", self.prefix_cache_hits, s.prefix_cache_hits)
        self._inc("preemptions", self.num_preemptions, s.num_preemptions)
        self._inc("prompt", self.prompt_tokens, engine.num_computed_prompt_tokens)
        self._inc("gen", self.generation_tokens, engine.num_generated_tokens)
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
        self._grammars(engine)

    def _grammars(self, engine) -> None:
        grammars = engine.processor.grammars
        self._inc("structured", self.structured_output_requests, grammars.num_requests)
        while grammars.compile_seconds:  # a deque the compiling threads append to
            self.grammar_compile_time.observe(grammars.compile_seconds.popleft())

    def _set_lora(self, s) -> None:
        """vLLM's lora_requests_info: one sample whose labels name the adapters running and waiting."""
        now = (s.running_lora_adapters, s.waiting_lora_adapters)
        if self.lora_info is None or now == self._lora_seen:
            return
        self._lora_seen = now
        self.lora_info.clear()  # only the current adapters' sample
        self.lora_info.labels(str(self.max_loras), ",".join(now[0]), ",".join(now[1])).set_to_current_time()

    def _inc(self, key: str, counter, total: int) -> None:
        if total > self._seen[key]:
            counter.inc(total - self._seen[key])
        self._seen[key] = total

    def on_finish(self, out: RequestOutput, children: list) -> None:
        end = time.monotonic()
        for req, comp in zip(children, out.outputs):
            self._success.labels(self.model_name, comp.finish_reason or "abort").inc()
            if req.first_token_time is not None:
                self.time_to_first_token.observe(req.first_token_time - req.arrival_time)
                if req.num_output_tokens > 1:
                    self.time_per_output_token.observe((end - req.first_token_time) / (req.num_output_tokens - 1))
            if req.scheduled_time is not None:
                self.request_queue_time.observe(req.scheduled_time - req.arrival_time)
            self.e2e_request_latency.observe(end - req.arrival_time)

    def log_line(self, engine) -> str:
        now = time.monotonic()
        t0, p0, g0 = self._log_mark
        dt = max(now - t0, 1e-9)
        p, gtok = engine.num_computed_prompt_tokens, engine.num_generated_tokens
        self._log_mark = (now, p, gtok)
        s = engine.stats()
        hit = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        return (f"Avg prompt throughput: {(p - p0) / dt:.1f} tokens/s, Avg generation throughput: "
                f"{(gtok - g0) / dt:.1f} tokens/s, Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {100 * hit:.1f}%")

    def refresh(self, engine) -> None:
        """Read the gauges fresh (for /metrics while idle); the seeds' gauges are read only here."""
        s = engine.stats()
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.kv_cache_usage_perc.set(s.kv_cache_usage)
        self._grammars(engine)
        self._set_lora(s)
        for name, value in seed_values(engine).items():
            self.seed_gauges[name].set(value)
