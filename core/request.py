"""A request's plain state as the scheduler and engine see it, and the outputs handed back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vserve.core.sampling_params import SamplingParams
from vserve.core.structured_output import GrammarSpec, GrammarState

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED  # a frozenset: this is asked per request per step


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass(slots=True)
class Request:
    """One sequence being generated. n > 1 becomes n Requests sharing the prompt (and its cached blocks)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    prompt: str | None = None
    parent_id: str | None = None
    index: int = 0  # which of the parent's n outputs this is
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0  # tokens sampled on the device, not yet appended (async scheduling)
    num_sent_tokens: int = 0  # output tokens already handed out as deltas (the engine process's outputs)
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache, set at first schedule
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None  # requests share cached prefix blocks only with requests of the same salt
    structured: GrammarSpec | None = None  # a structured output's compiled grammar (core/structured_output.py)
    grammar: GrammarState | None = None  # its matcher, in the engine core
    lora_id: int = 0  # its LoRA adapter's id (0: none); the adapter's name and folder come with it
    lora_name: str | None = None
    lora_path: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] | None = None
    # prompt_logprobs: (first position, device tensors) per prefill chunk, until the first output carries them
    prompt_logprob_parts: list | None = None
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were computed (a recompute skips them)
    stop_reason: int | str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admitted by the scheduler
    first_token_time: float | None = None
    token_limit: int = 0  # prompt + max_tokens: the token count at which the length limit stops it

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.token_limit = len(self.prompt_token_ids) + self.max_tokens
        if self.sampling_params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: CompletionOutput) -> CompletionOutput:
        """This delta followed by the next one of the same output, as one delta."""
        lps = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        cum = None if self.cumulative_logprob is None else self.cumulative_logprob + (later.cumulative_logprob or 0.0)
        return CompletionOutput(later.index, self.text + later.text, self.token_ids + later.token_ids, cum, lps,
                                later.finish_reason, later.stop_reason)


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: None for the first prompt token, then its token's Logprob and the top-N
    prompt_logprobs: list | None = None

    @property
    def text(self) -> str:
        """The first completion's text (outputs[0].text)."""
        return self.outputs[0].text if self.outputs else ""
