"""EngineCore: the engine's stepping half (vLLM V1's EngineCore): scheduler, KV cache and model runner, nothing else.

It takes requests as token ids and gives back, per step, each request's new token (and logprobs where asked) as a
compact tuple; token-level stops (EOS, stop token ids, max_tokens, the context length) end a request here. Text,
stop strings and `RequestOutput`s are the front end's (core/output_processor.py), which runs in the caller's process
and tells the core to abort a request whose stop string it found. core/core_client.py carries the messages to and
from a core in this process or in an engine process of its own.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref

import torch

from vserve.core.config import EngineConfig
from vserve.core.kv_cache import KVCacheManager
from vserve.core.layers.rotary import longrope_offset
from vserve.core.loader import build_model, needs_activation_profile, pick_device, pick_dtype
from vserve.core.lora import attach_lora
from vserve.core.memory import GiB, plan_memory
from vserve.core.messages import CoreInfo, CoreOutput, CoreStats, EngineStats, StepOutputs
from vserve.core.model_config import model_source
from vserve.core.model_runner import ModelRunner, kv_cache_torch_dtype
from vserve.core.processor import max_model_len_for
from vserve.core.prompt_logprobs import take as take_prompt_logprobs
from vserve.core.request import Request, RequestStatus
from vserve.core.sampler import SampledTokens
from vserve.core.scheduler import Scheduler
from vserve.core.structured_output import StructuredOutputManager
from vserve.core.worker import start_tensor_parallel
from vserve.ops import startup

log = logging.getLogger("vserve.engine")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        from vserve.core.hub import resolve_model_files

        with startup.phase("resolve model"):
            self.config = config = resolve_model_files(config)  # hub ids -> cached snapshot paths
            path, fmt, self.model_config = model_source(config)
        mc = self.model_config
        self.max_model_len = max_model_len_for(config, mc)
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

    def _init_rank0(self, config: EngineConfig, path, fmt: str) -> None:
        mc = self.model_config
        self.dtype = pick_dtype(config.dtype, mc, self.device)
        kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype, self.device)  # before loading: GPUs without fp8
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
            kv_cache_bytes=c.kv_cache_memory_gib * GiB if c.kv_cache_memory_gib else None,
            sliding_window=mc.kv_window(), max_loras=c.max_loras if c.enable_lora else 0,
            max_lora_rank=c.max_lora_rank,
            prefix_cache_bytes=int(c.cache_size_gb * GiB) if c.cache_size_gb else None, **measured)
        self.memory_plan.check()
        num_blocks = self.memory_plan.num_blocks
        if self.workers is not None:
            from vserve.core import distributed

            ring = distributed.open_step_ring() if config.nnodes == 1 else None  # else steps go over gloo
            distributed.broadcast_object({"num_blocks": num_blocks, "max_model_len": self.max_model_len,
                                          "step_ring": ring})
        # where every layer slides, blocks behind the window go back to the pool as a request moves on
        longrope = longrope_offset(mc.rope_scaling, mc.max_position_embeddings)
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, sliding_window=mc.kv_window(),
                                 longrope_original=longrope[0] if longrope else None,
                                 max_cached_free_blocks=self.memory_plan.prefix_cache_max_blocks)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_chunked_prefill,
                                   config.long_prefill_token_threshold)
        lora = attach_lora(self.model, config, self.dtype, self.device)
        self.lora_slot_bytes = lora.nbytes() if lora is not None else 0  # as allocated (the plan predicts lora_bytes)
        # CUDA graphs are not captured under TP/PP yet (collectives inside captured graphs are untested).
        self.runner = ModelRunner(self.model, mc, bs, num_blocks, self.dtype, self.device, config.seed,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager or multi, kv_cache_dtype=config.kv_cache_dtype,
                                  lora=lora)
        if lora is not None:
            from vserve.core.lora.manager import LoRASlots

            self.scheduler.lora = self.runner.lora_slots = LoRASlots(config.max_loras)
        self.async_scheduling = (self.device.type == "cuda" and not multi if config.async_scheduling is None
                                 else config.async_scheduling)
        self.in_flight: tuple[list[Request], SampledTokens | None] | None = None  # launched, not yet processed
        self.early_outs: StepOutputs | None = None  # the step before's outputs, processed to fill a grammar bitmask
        self.structured = StructuredOutputManager(mc.vocab_size)
        self.num_grammars = 0  # live requests with a structured output
        self.requests: dict[str, Request] = {}
        self.num_taken = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model (cache hits excluded)
        self.last_step_tokens = 0  # tokens computed by the last step

    def info(self) -> CoreInfo:
        return CoreInfo(str(self.dtype).removeprefix("torch."), str(self.device), self.max_model_len,
                        self.async_scheduling, {**self.memory_plan.as_dict(), "lora_slot_bytes": self.lora_slot_bytes})

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.structured is not None:  # first: a grammar sent with a request is kept whatever fails below
            self.structured.receive(req.structured)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.lora_id:
            if self.scheduler.lora is None:
                raise ValueError("this engine serves no LoRA adapters: start it with --enable-lora")
            self.scheduler.lora.register(req.lora_id, req.lora_name, req.lora_path)
        if req.sampling_params.prompt_logprobs is not None and self.config.pipeline_parallel_size > 1:
            raise ValueError("prompt_logprobs is not supported with --pipeline-parallel-size > 1")
        if req.sampling_params.seed is not None and req.generator is None:
            req.generator = torch.Generator().manual_seed(req.sampling_params.seed)  # CPU: cheap per-row draws
        if req.structured is not None:
            req.grammar = self.structured.new_state(req.structured, req.sampling_params.all_stop_token_ids)
            self.num_grammars += 1
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)
        self.num_taken += 1
        self.num_prompt_tokens += req.num_prompt_tokens

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these requests (unknown or finished ones are skipped): their blocks go back to the pool."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is not None and not req.status.finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED)

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """Read an adapter added by name into the CPU cache now, so its first request's step does not wait for the
        disk (the front end checked the folder; a failure here is logged and left to that first step)."""
        if self.scheduler.lora is None:
            return
        self.scheduler.lora.register(lora_id, name, path)
        try:
            self.runner.lora.adapter(lora_id, path)
        except Exception as e:  # a folder changed since the front end checked it
            log.warning("could not preload LoRA adapter %r from %s: %r", name, path, e)

    def remove_lora(self, lora_id: int) -> None:
        """Forget an adapter its front end removed: its slot frees once no running request uses it."""
        if self.scheduler.lora is not None:
            self.scheduler.lora.forget(lora_id)
            self.runner.lora.forget(lora_id)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        """schedule -> run -> sample -> append and check token stops -> each sampling request's new token.

        With async scheduling the step is launched and the previous step's tokens are processed while it runs,
        so the host's work overlaps the device's; a step's tokens come back from the next call. A request that
        stopped in the step before may have been scheduled once more: that token is dropped."""
        if self.failure is not None:
            raise self.failure
        outs = StepOutputs()
        if self.in_flight is not None and not self._can_overlap():
            outs.extend(self._process(self.in_flight))
            self.in_flight = None
        sched = self.scheduler.schedule()
        self.last_step_tokens = sched.total_tokens
        if sched.is_empty():
            if self.in_flight is None and not outs:
                if self.scheduler.waiting and not self.scheduler.running:
                    raise RuntimeError("a waiting request cannot be scheduled even with an empty KV cache")
                return outs
            launched = None
        else:
            launched = self._launch(sched)
        prev, self.in_flight = self.in_flight, launched
        if prev is not None:
            outs.extend(self._process(prev))
        if not self.async_scheduling and self.in_flight is not None:
            outs.extend(self._process(self.in_flight))
            self.in_flight = None
        if self.early_outs is not None:
            outs, self.early_outs = self.early_outs.extend(outs), None
        return outs

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is processed. Penalties, min_tokens,
        logit bias and logprobs need nothing the host lacks (the sampler keeps their state on the device)."""
        return self.async_scheduling

    def _launch(self, sched) -> tuple[list[Request], SampledTokens | None]:
        block_table = self.kv.block_table(sched.requests)
        self.num_computed_prompt_tokens += sched.num_prompt_tokens
        try:
            reqs, sampled = self.runner.launch(sched, block_table,
                                               self._grammar_bitmask if self.num_grammars else None)
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

    def _grammar_bitmask(self, reqs: list[Request]):
        """Called by the runner once the step's forward is queued: the step in flight before it is processed first
        (its tokens advance the matchers; under async scheduling this overlaps the forward), then the rows with an
        active grammar get their bitmask."""
        if not any(r.grammar is not None for r in reqs):
            return None
        if self.in_flight is not None:
            early = self._process(self.in_flight)
            self.early_outs = early if self.early_outs is None else self.early_outs.extend(early)
            self.in_flight = None
        return self.structured.bitmask([r.grammar for r in reqs])

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self.runner.sampler.release(req.request_id)
        if req.grammar is not None:
            req.grammar = None
            self.num_grammars -= 1

    def _process(self, launched: tuple[list[Request], SampledTokens | None]) -> StepOutputs:
        """Append a launched step's tokens (waiting for them) and check the token stops."""
        reqs, sampled = launched
        outs = StepOutputs()
        if sampled is None:
            return outs
        out = sampled.resolve()
        now = time.monotonic()
        running = RequestStatus.RUNNING
        max_len = self.max_model_len
        plain_ids, plain_tokens = outs.request_ids, outs.token_ids
        for req, token, lp in zip(reqs, out.token_ids, out.logprobs):
            req.num_pending -= 1
            if req.status is not running and req.status.finished:  # stopped by the step before, or aborted
                continue
            first = req.first_token_time is None
            if first:
                req.first_token_time = now
            output_ids, all_ids = req.output_token_ids, req.all_token_ids
            output_ids.append(token)  # req.append_token, inlined (this loop runs for every row of every step)
            all_ids.append(token)
            sp = req.sampling_params
            plp = take_prompt_logprobs(req) if sp.prompt_logprobs is not None else None
            # _check_stop decides; asked only when one of its conditions can hold
            status = (self._check_stop(req, token) if token in sp.all_stop_token_ids
                      or len(output_ids) >= req.max_tokens or len(all_ids) >= max_len else None)
            if status is None and req.grammar is not None and self.structured.accept(req.grammar, token):
                status = RequestStatus.FINISHED_STOPPED  # the structured output is complete
            if status is None:
                if first or lp is not None or plp is not None:
                    outs.add_full(CoreOutput(req.request_id, token, lp, None, None, max(req.num_cached_tokens, 0),
                                             None, None, plp))
                else:  # the common row: its token alone
                    plain_ids.append(req.request_id)
                    plain_tokens.append(token)
                continue
            self._finish(req, status)
            del self.requests[req.request_id]
            outs.add_full(CoreOutput(req.request_id, token, lp, status.value, req.stop_reason,
                                     max(req.num_cached_tokens, 0), req.first_token_time, req.scheduled_time, plp))
        self.num_generated_tokens += len(outs)
        return outs

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if token in sp.all_stop_token_ids and req.num_output_tokens >= sp.min_tokens:
            req.stop_reason = None if token == req.eos_token_id else token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the other tensor-parallel ranks (a no-op for one process)."""
        workers, self.workers = getattr(self, "workers", None), None
        if workers is None:
            return
        from vserve.core import distributed

        if graceful:
            try:
                distributed.broadcast_step(None)
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
            **(self._lora_adapters() if self.scheduler.lora is not None else {}),
        )

    def _lora_adapters(self) -> dict:
        s = self.scheduler
        return {"running_lora_adapters": tuple(sorted({r.lora_name for r in s.running if r.lora_id})),
                "waiting_lora_adapters": tuple(sorted({r.lora_name for r in s.waiting if r.lora_id}))}

    def core_stats(self, seconds: float) -> CoreStats:
        return CoreStats(self.stats(), self.num_generated_tokens, self.num_computed_prompt_tokens,
                         self.last_step_tokens, seconds, self.num_taken, self.structured.times())
