"""Sampling parameters of one request, validated at construction (vLLM's names and semantics)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

from vserve.core.structured_output import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick the next tokens of a request.

    Order of logit processing (docs/architecture.md): logit_bias, min_tokens masking, repetition
    penalty (prompt and output tokens), frequency and presence penalties (output tokens), temperature,
    then top_k, top_p, min_p. temperature == 0 is greedy (argmax of the processed logits).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeat_penalty: float | None = None  # llama.cpp's name for repetition_penalty (an alias: sets it)
    length_penalty: float = 1.0  # acts in beam search only (BeamSearchParams); here 1.0, the seeds' value
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # The prompt's tokens' logprobs (top-N plus the prompt's own token), computed in the prefill pass; such a request
    # does not read the prefix cache (a cached block has no logits to give).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Offline use clips max_tokens to what fits in --max-model-len; the server refuses instead (400).
    truncate_max_tokens: bool = True
    # A JSON schema, regex, choice, grammar or structural tag the output must follow (xgrammar).
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's name before 0.11: moved to structured_outputs
    # Set by the engine from the tokenizer: eos and generation-config stop ids.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.repeat_penalty is not None:
            if self.repetition_penalty not in (1.0, self.repeat_penalty):
                raise ValueError(f"repeat_penalty is llama.cpp's name for repetition_penalty: give one, got "
                                 f"repeat_penalty={self.repeat_penalty!r}, "
                                 f"repetition_penalty={self.repetition_penalty!r}")
            self.repetition_penalty, self.repeat_penalty = self.repeat_penalty, None
        if self.length_penalty != 1.0:
            raise ValueError(f"length_penalty acts in beam search: LLM.beam_search(prompts, BeamSearchParams("
                             f"beam_width=4, max_tokens=..., length_penalty={self.length_penalty!r})); sampling "
                             f"takes only 1.0")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its old name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", ">= 1")
        if self.temperature < 0:
            raise bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "-1, 0 (no limit) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise bad("repetition_penalty", "in (0, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", ">= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}"
            )
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", ">= 0")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", ">= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        for tok, bias in (self.logit_bias or {}).items():
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {tok}")

    @property
    def needs_logit_processing(self) -> bool:
        """Any of logit_bias, min_tokens or a penalty is set (the sampler skips the rest per row)."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0 or self.frequency_penalty
                    or self.presence_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Token ids named by the caller must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids)):
            out = [t for t in ids if t >= vocab_size]
            if out:
                raise ValueError(f"{name} has token ids outside the vocabulary (size {vocab_size}): {out[:5]}")


def _refuse_engine_args(init):
    """An engine argument given to SamplingParams (a seed's `SamplingParams(max_num_seqs=16)`) is a ValueError that
    says where it belongs, not a TypeError."""
    from vserve.core.config import EngineConfig  # a plain dataclass: no torch

    engine_names = {f.name for f in fields(EngineConfig)} - {f.name for f in fields(SamplingParams)} - {"sources"}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        misplaced = [k for k in kwargs if k in engine_names]
        if misplaced:
            k = misplaced[0]
            raise ValueError(f"{k} is an engine argument: LLM(..., {k}={kwargs[k]!r})")
        init(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _refuse_engine_args(SamplingParams.__init__)
