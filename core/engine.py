"""LLMEngine: add_request / abort_request / step over the scheduler, KV cache manager and model runner."""

from __future__ import annotations

import atexit
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from vserve.core.config import EngineConfig
from vserve.core.detokenizer import IncrementalDetokenizer
from vserve.core.kv_cache import KVCacheManager
from vserve.core.loader import build_model, model_source, needs_activation_profile, pick_device, pick_dtype
from vserve.core.memory import GiB, plan_memory
from vserve.core.model_runner import ModelRunner, kv_cache_torch_dtype
from vserve.core.processor import InputProcessor
from vserve.core.request import CompletionOutput, Request, RequestOutput, RequestStatus
from vserve.core.sampler import SampledTokens
from vserve.core.sampling_params import SamplingParams
from vserve.core.scheduler import Scheduler
from vserve.core.worker import start_tensor_parallel
from vserve.ops import startup


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from vserve.core.hub import resolve_model_files

        with startup.phase("resolve model"):
            self.config = config = resolve_model_files(config)  # hub ids -> cached snapshot paths
            path, fmt, self.model_config = model_source(config)
        mc = self.model_config
        self.device = pick_device(config.device)
        self.workers = None
        self.failure: RuntimeError | None = None  # a lost rank: every later step raises it
        if config.node_rank != 0:
            raise ValueError("--node-rank > 0 runs ranks only (vserve serve/generate do that); the engine is node 0")
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.workers, self.device = start_tensor_parallel(config, mc, self.device)
            ref = weakref.ref(self)
            atexit.register(lambda: (e := ref()) is not None and e.shutdown())  # let the other ranks exit 0
        try:
            self._init_rank0(config, path, fmt)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def _init_rank0(self, config: EngineConfig, path: Path, fmt: str) -> None:
        mc = self.model_config
        self.dtype = pick_dtype(config.dtype, mc, self.device)
        kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype, self.device)  # before loading: GPUs without fp8
        self.processor = InputProcessor(config, path, fmt, mc)
        self.max_model_len = self.processor.max_model_len
        self.tokenizer = self.processor.tokenizer
        self.stop_token_ids = self.processor.stop_token_ids
        with startup.phase("weights"):
            self.model = build_model(mc, path, fmt, self.dtype, self.device, config.seed, config.quantization)

        bs, tp = config.block_size, config.tensor_parallel_size
        multi = tp * config.pipeline_parallel_size > 1
        c, measured = config, {}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            measured["gpu_memory_bytes"] = total
            if needs_activation_profile(c, self.device):
                from vserve.core.model_runner import profile_peak_activation

                measured["in_use_bytes"] = total - free
                with startup.phase("memory profile"):
                    measured["peak_activation_bytes"] = profile_peak_activation(
                        self.model, mc, c.max_num_batched_tokens, self.max_model_len, c.max_num_seqs, bs,
                        self.dtype, self.device)
        # One planner for the engine and `vserve doctor`; here it is fed what was measured.
        self.memory_plan = plan_memory(
            mc, gpu_memory_bytes=measured.pop("gpu_memory_bytes", None), dtype_bytes=self.dtype.itemsize,
            quantization=getattr(self.model, "quant_config", None),
            tensor_parallel_size=tp, block_size=bs, max_model_len=self.max_model_len,
            max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
            gpu_memory_utilization=c.gpu_memory_utilization, cuda_graphs=not c.enforce_eager and not multi,
            num_kv_blocks=c.num_kv_blocks, kv_dtype_bytes=1 if c.kv_cache_dtype.startswith("fp8") else None,
            kv_cache_bytes=c.kv_cache_memory_gib * GiB if c.kv_cache_memory_gib else None, **measured)
        self.memory_plan.check()
        num_blocks = self.memory_plan.num_blocks
        if self.workers is not None:
            from vserve.core.distributed import broadcast_object

            broadcast_object({"num_blocks": num_blocks, "max_model_len": self.max_model_len})
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_chunked_prefill)
        # CUDA graphs are not captured under TP/PP yet (collectives inside captured graphs are untested).
        self.runner = ModelRunner(self.model, mc, bs, num_blocks, self.dtype, self.device, config.seed,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager or multi, kv_cache_dtype=config.kv_cache_dtype)
        self.async_scheduling = (self.device.type == "cuda" and not multi if config.async_scheduling is None
                                 else config.async_scheduling)
        self.in_flight: tuple[list[Request], SampledTokens] | None = None  # launched, tokens not yet processed
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.parents: dict[str, list[Request]] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model (cache hits excluded)
        self.last_step_tokens = 0  # tokens computed by the last step
        self.last_finished: dict[str, list[Request]] = {}  # parents finished in the last step -> children

    @property
    def eos_token_id(self) -> int | None:
        return self.processor.eos_token_id

    # ---- requests -------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.processor.tokenize(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        """Validate, then enqueue params.n child requests; nothing is enqueued if anything is invalid."""
        self.submit(self.make_requests(request_id, prompt, params, cache_salt))

    def make_requests(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      cache_salt: str | None = None) -> list[Request]:
        """Tokenize and validate (ValueError for bad input) without touching engine state."""
        return self.processor.make_requests(request_id, prompt, params, cache_salt)

    def submit(self, children: list[Request]) -> None:
        """Enqueue the children of one request (made by make_requests)."""
        request_id = children[0].parent_id
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.parents[request_id] = children
        for req in children:
            if req.sampling_params.seed is not None and req.generator is None:
                req.generator = torch.Generator().manual_seed(req.sampling_params.seed)  # CPU: cheap per-row draws
            self.requests[req.request_id] = req
            self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                                       req.sampling_params)
            self.scheduler.add_request(req)
        self.num_prompt_tokens += children[0].num_prompt_tokens * len(children)

    def abort_request(self, request_id: str) -> None:
        for req in self.parents.pop(request_id, []):
            if not req.status.finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self.requests.pop(req.request_id, None)
            self.detokenizers.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self, finished_only: bool = False, delta: bool = False) -> list[RequestOutput]:
        """schedule -> run -> sample -> append and check stops -> outputs of requests that changed (or, with
        finished_only, of those that finished: offline batches need no per-step outputs). With delta, each
        output holds only what is new since that request's last output (tokens, text, logprobs).

        With async scheduling the step is launched and the previous step's tokens are processed while it runs,
        so the host's work overlaps the device's; a step's outputs come back from the next call. A request that
        stopped in the step before may have been scheduled once more: that token is dropped."""
        if self.failure is not None:
            raise self.failure
        self.last_finished = {}
        outs: list[RequestOutput] = []
        if self.in_flight is not None and not self._can_overlap():
            outs += self._process(self.in_flight, finished_only, delta)
            self.in_flight = None
        sched = self.scheduler.schedule()
        self.last_step_tokens = sched.total_tokens
        if sched.is_empty():
            if self.in_flight is None and not outs:
                if self.scheduler.waiting and not self.scheduler.running:
                    raise RuntimeError("a waiting request cannot be scheduled even with an empty KV cache")
                return []
            launched = None
        else:
            launched = self._launch(sched)
        prev, self.in_flight = self.in_flight, launched
        if prev is not None:
            outs += self._process(prev, finished_only, delta)
        if not self.async_scheduling and self.in_flight is not None:
            outs += self._process(self.in_flight, finished_only, delta)
            self.in_flight = None
        return outs

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is processed: not when a request's
        sampling reads its own latest tokens (penalties, min_tokens, logit bias) or wants logprobs."""
        if not self.async_scheduling:
            return False
        return not any(r.sampling_params.needs_logit_processing or r.sampling_params.logprobs is not None
                       for r in self.scheduler.running)

    def _launch(self, sched) -> tuple[list[Request], SampledTokens | None]:
        block_ids = [self.kv.get_block_ids(r.request_id) for r in sched.requests]
        for r, n in zip(sched.requests, sched.num_scheduled_tokens):
            self.num_computed_prompt_tokens += max(0, min(n, r.num_prompt_tokens - r.num_computed_tokens))
        try:
            reqs, sampled = self.runner.launch(sched, block_ids)
        except Exception as e:
            if self.workers is None:
                raise
            self.failure = self.workers.failure(e)
            self.shutdown(graceful=False)
            raise self.failure from e
        self.scheduler.update_after_step(sched)
        for req in reqs:
            req.num_pending += 1
        return reqs, sampled

    def _process(self, launched: tuple[list[Request], SampledTokens | None], finished_only: bool,
                 delta: bool = False) -> list[RequestOutput]:
        """Append a launched step's tokens (waiting for them), check stops, and make the outputs."""
        reqs, sampled = launched
        if sampled is None:
            return []
        out = sampled.resolve()
        now = time.monotonic()
        changed: dict[str, None] = {}
        for req, token, lp in zip(reqs, out.token_ids, out.logprobs):
            req.num_pending -= 1
            if req.status.finished:  # stopped by the step before, or aborted, while this one ran
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            req.append_token(token)
            self.num_generated_tokens += 1
            if lp is not None:
                req.logprobs.append(lp)
            status = self._check_stop(req, token)
            if status is not None:
                self.scheduler.finish(req, status)
                changed[req.parent_id] = None
            elif not finished_only:
                changed[req.parent_id] = None
        outs = [self._make_output(pid, delta) for pid in changed]
        return [o for o in outs if o.finished] if finished_only else outs

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        detok = self.detokenizers[req.request_id]
        can_stop = req.num_output_tokens >= sp.min_tokens
        if can_stop and token in sp.all_stop_token_ids:
            req.stop_reason = None if token == req.eos_token_id else token
            return RequestStatus.FINISHED_STOPPED
        stop_str = detok.update(token, check_stop=can_stop)
        if stop_str is not None:
            req.stop_reason = stop_str
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, parent_id: str, delta: bool = False) -> RequestOutput:
        children = self.parents[parent_id]
        outs = []
        for req in children:
            finished = req.status.finished
            detok = self.detokenizers[req.request_id]
            start = req.num_sent_tokens if delta else 0
            token_ids = req.output_token_ids[start:]
            lps = req.logprobs[start:] if req.logprobs is not None and delta else req.logprobs
            if delta:
                req.num_sent_tokens = req.num_output_tokens
            outs.append(CompletionOutput(
                index=req.index,
                text=detok.new_text(finished) if delta else detok.text(finished),
                token_ids=token_ids,
                cumulative_logprob=sum(d[t].logprob for d, t in zip(lps, token_ids)) if lps is not None else None,
                logprobs=lps,
                finish_reason=req.status.value if finished else None,
                stop_reason=req.stop_reason,
            ))
        first = children[0]
        done = all(r.status.finished for r in children)
        out = RequestOutput(parent_id, first.prompt, first.prompt_token_ids, outs, done,
                            num_cached_tokens=max(first.num_cached_tokens, 0))
        if done:
            self.last_finished[parent_id] = children
            self.parents.pop(parent_id)
            for req in children:
                self.requests.pop(req.request_id, None)
                self.detokenizers.pop(req.request_id, None)
        return out

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the other tensor-parallel ranks (a no-op for one process)."""
        workers, self.workers = getattr(self, "workers", None), None
        if workers is None:
            return
        from vserve.core import distributed

        if graceful:
            try:
                distributed.broadcast_object(None)
            except Exception:  # a rank already gone: nothing to tell it
                graceful = False
        workers.shutdown(timeout_s=10.0 if graceful else 0.0)
        distributed.destroy_distributed()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_free_blocks=self.kv.num_free_blocks(),
            num_blocks=self.kv.pool.num_blocks,
        )
