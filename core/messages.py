"""What the front end and the engine core say to each other (core/core_client.py carries it), torch-free.

The front end (LLMEngine, AsyncLLM, the API process) imports only this side of the engine: the engine process
(core/engine_core.py) is the one that imports torch, so a server or an offline run that spawns its engine process
starts tokenizing while that process is still importing torch and loading weights (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from vserve.core.request import Request


class Logprob(NamedTuple):
    """One token's logprob and rank (vLLM's Logprob), immutable. A run keeps one per token and top-N entry; what
    keeps the collector from rescanning them is core_client.tune_gc (this type alone measured no different)."""

    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# A token's logprobs as the core sends them: (token ids, logprobs, ranks), the sampled token first, then the top-N
# without it. Plain lists pickle in C; the front end makes the Logprob dicts users see (logprobs_dict).
CompactLogprobs = tuple[list[int], list[float], list[int]]


def logprobs_dict(lp: CompactLogprobs) -> dict[int, Logprob]:
    ids, vals, ranks = lp
    return {t: Logprob(v, r) for t, v, r in zip(ids, vals, ranks)}


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
    running_lora_adapters: tuple[str, ...] = ()  # the adapters of running / waiting requests (LoRA on)
    waiting_lora_adapters: tuple[str, ...] = ()


@dataclass(slots=True)
class CoreStats:
    """What one engine message says of the engine: EngineStats plus the counters metrics read."""

    engine: EngineStats
    num_generated_tokens: int
    num_computed_prompt_tokens: int
    last_step_tokens: int
    step_seconds: float
    num_taken: int  # requests the core has been given
    grammar: tuple[float, int, int, float, int] = (0.0, 0, 0, 0.0, 0)  # StructuredOutputManager.times()


class CoreOutput(NamedTuple):
    """One request's new token of one step. finish_reason is "stop" (a stop token: stop_reason is that token, or
    None for EOS), "length", or None while it runs; the times come with the finished output."""

    request_id: str
    token_id: int
    logprobs: CompactLogprobs | None
    finish_reason: str | None
    stop_reason: int | None
    num_cached_tokens: int
    first_token_time: float | None
    scheduled_time: float | None
    prompt_logprobs: list | None = None  # with the first token of a request that asked for them


@dataclass(slots=True)
class StepOutputs:
    """One step's new tokens, as columns: row i is request_ids[i]'s token_ids[i]. The rows that carry more than a
    token (their first token, with its cache hits; logprobs; prompt logprobs; a finish) also have their CoreOutput
    in `full`, by row. At 256 rows the columns pickle ~25x faster than a CoreOutput a row (0.35 ms a step on this
    project's CPU), and the engine process sends one of these every step."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    full: dict[int, CoreOutput] = field(default_factory=dict)

    def add_full(self, out: CoreOutput) -> None:
        self.full[len(self.request_ids)] = out
        self.request_ids.append(out.request_id)
        self.token_ids.append(out.token_id)

    def extend(self, later: StepOutputs) -> StepOutputs:
        """These rows, then `later`'s (self, extended)."""
        n = len(self.request_ids)
        self.request_ids += later.request_ids
        self.token_ids += later.token_ids
        self.full.update({n + i: out for i, out in later.full.items()})
        return self

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class CoreInfo:
    """What the front end learns of a core once it is built."""

    dtype: str
    device: str
    max_model_len: int
    async_scheduling: bool
    memory_plan: dict


def encode_request(req: Request) -> tuple:
    return (req.request_id, req.prompt_token_ids, req.sampling_params, req.max_tokens, req.parent_id, req.index,
            req.eos_token_id, req.arrival_time, req.cache_salt, req.structured, req.lora_id, req.lora_name,
            req.lora_path)


def decode_request(t: tuple) -> Request:
    rid, ids, sp, max_tokens, parent_id, index, eos, arrival, salt, structured, lora_id, lora_name, lora_path = t
    return Request(request_id=rid, prompt_token_ids=ids, sampling_params=sp, max_tokens=max_tokens,
                   parent_id=parent_id, index=index, eos_token_id=eos, arrival_time=arrival, cache_salt=salt,
                   structured=structured, lora_id=lora_id, lora_name=lora_name, lora_path=lora_path)


