"""One-budget scheduler: running requests first, then waiting ones; chunked prefill; preemption by recompute."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from vserve.core.kv_cache import KVCacheManager
from vserve.core.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """The step's plan: which requests run and how many of their tokens, decodes first."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prompt_tokens: int = 0  # of the scheduled tokens, those of prompts (prefix-cache hits not counted)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 long_prefill_token_threshold: int | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.lora = None  # the engine's LoRASlots when LoRA is on: a request runs only with its adapter in a slot
        self.max_chunk = long_prefill_token_threshold or max_num_batched_tokens  # one request's prefill per step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        max_len, max_chunk, kv = self.max_model_len, self.max_chunk, self.kv
        # Decodes first, then prefills: the attention backend batches the single-token rows together. A list
        # each, in running order (what is admitted below runs last), filled as requests are scheduled.
        decodes: list[Request] = []
        prefills: list[Request] = []
        prefill_nums: list[int] = []
        num_prompt = 0

        # 1. Running requests, oldest first; the newest is preempted when blocks run out (never one scheduled
        # already: they come first). Under async scheduling a request's token sampled by the step in flight counts
        # as known (num_pending); one that will then have reached its length limit is not scheduled again.
        # This loop runs for every running request every step: plain comparisons instead of min(), bound methods
        # and dict.get hoisted (at 256 decode rows it is the largest share of the engine's host time a step).
        i = 0
        running = self.running
        n_running = len(running)
        room_get = kv.room.get
        add_decode = decodes.append
        while i < n_running and budget > 0:
            req = running[i]
            pending = req.num_pending
            num_tokens = len(req.all_token_ids) + pending
            if pending and (num_tokens >= req.token_limit or num_tokens >= max_len):  # token_limit: prompt + max
                i += 1
                continue
            computed = req.num_computed_tokens
            num_new = num_tokens - computed
            if num_new > budget:
                num_new = budget
            if num_new > max_chunk:
                num_new = max_chunk
            if computed + num_new > room_get(req.request_id, -1):  # else allocate_slots would change nothing
                while kv.allocate_slots(req, num_new) is None:
                    victim = running.pop()
                    n_running -= 1
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        num_new = 0
                        break
            if num_new == 0:
                break
            if num_new == 1:
                add_decode(req)
            else:
                prefills.append(req)
                prefill_nums.append(num_new)
            prompt_left = len(req.prompt_token_ids) - computed
            if prompt_left > 0:
                num_prompt += num_new if num_new < prompt_left else prompt_left
            budget -= num_new
            i += 1

        # 2. Waiting requests, in arrival order, while nothing was preempted this step.
        while self.waiting and budget > 0 and len(running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if req.num_pending:  # preempted with a token in flight: admit it once that token is appended
                break
            if self.lora is not None and not self.lora.can_admit(req):  # every slot busy: wait (and those behind)
                break
            hits, num_hit_tokens = ([], 0)
            if req.num_computed_tokens == 0:
                hits, num_hit_tokens = kv.get_computed_blocks(req)
            num_new = req.num_tokens - req.num_computed_tokens - num_hit_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            num_new = min(num_new, max_chunk)
            if kv.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.popleft()
            if self.lora is not None:
                self.lora.acquire(req)
            req.num_computed_tokens += num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
                req.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            running.append(req)
            if num_new == 1:
                decodes.append(req)
            else:
                prefills.append(req)
                prefill_nums.append(num_new)
            num_prompt += max(0, min(num_new, req.num_prompt_tokens - req.num_computed_tokens))
            budget -= num_new

        out.requests = decodes + prefills
        out.num_scheduled_tokens = [1] * len(decodes) + prefill_nums
        out.num_prompt_tokens = num_prompt
        return out

    def _preempt(self, req: Request) -> None:
        """Free the victim's blocks and queue it first; it recomputes prompt + output so far later."""
        self.kv.free(req)
        if self.lora is not None:
            self.lora.release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            req.num_computed_tokens += n

    def finish(self, req: Request, status: RequestStatus) -> None:
        assert status.finished
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        if self.lora is not None:
            self.lora.release(req)
