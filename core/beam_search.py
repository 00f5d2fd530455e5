"""Beam search (vLLM's `LLM.beam_search` and `BeamSearchParams`) with HF transformers' semantics.

As vLLM does it, the search runs on top of generation: each step every live beam is one request of one greedy token
asking for the top-K logprobs of its next token, and the prefix cache shares the blocks of the prompt and of the
beams' common prefixes (each request takes a reference on the cached blocks it hits; only a beam's last partial block
is computed again). Which candidates survive, how finished hypotheses are scored and when the search stops follow
`transformers`' `_beam_search` for one prompt:

- each step the top K = max(2, 1 + number of EOS ids) * beam_width continuations over all beams (their running
  log-probability sums) are taken; those that end in EOS, or reach max_tokens, and rank among the first beam_width
  become finished hypotheses scored sum / generated_len ** length_penalty (the best beam_width are kept); the best
  beam_width of the others run on;
- the search stops at max_tokens, or with early_stopping=True once beam_width hypotheses are finished, or (False,
  the default) once beam_width are finished and the best running beam's sum / its current length ** length_penalty
  cannot beat the worst of them ("never": the same test at max_tokens' length when length_penalty > 0).

Under a structured output (`BeamSearchParams.structured_outputs`) each beam's step request carries the grammar and
the beam's tokens so far (`StructuredOutputsParams.beam_prefix`): the core's matcher accepts them, masks the step,
and lists the top logprobs among the allowed tokens only, so every candidate keeps the beam inside the grammar (HF's
beam search with a logits processor that sets disallowed tokens to -inf: the scores stay the model's log-softmax).
A beam whose grammar is complete may take only EOS, which finishes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from vserve.core.messages import Logprob

if TYPE_CHECKING:
    from vserve.core.structured_output import StructuredOutputsParams


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (plus HF's early_stopping, whose default False is HF's)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    structured_outputs: StructuredOutputsParams | None = None  # vserve's: every beam stays inside this grammar

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise ValueError(f"beam search is deterministic here: temperature must be 0, got {self.temperature!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError("beam search under a structured output needs EOS (a beam whose grammar is complete "
                             "ends with it): ignore_eos must be False")


@dataclass
class BeamSearchSequence:
    """One returned hypothesis: tokens are the prompt's then the generated ones (vLLM's shape); score is the
    length-penalised sum that ranks it."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    score: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]  # generated so far
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float


class BeamSearch:
    """One prompt's search: `pending()` gives the token sequences to score next (prompt + each live beam), and
    `advance()` takes each one's next-token logprobs (top K at least) in the same order."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_token_ids: set[int], max_tokens: int) -> None:
        self.prompt, self.params = prompt, params
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.max_tokens = max_tokens
        self.num_top = max(2, 1 + len(self.eos)) * params.beam_width  # candidates kept per step (HF's beams_to_keep)
        self.running = [_Beam([], [], 0.0)]  # HF's other initial beams score -1e9: they never rank
        self.finished: list[tuple[float, _Beam, str]] = []  # (score, beam, finish reason), best first
        self.step = 0
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def pending(self) -> list[list[int]]:
        return [] if self.done else [self.prompt + b.tokens for b in self.running]

    def advance(self, next_logprobs: list[dict[int, Logprob]]) -> None:
        width, lp = self.params.beam_width, self.params.length_penalty
        cands = sorted(((b.cum_logprob + e.logprob, i, tok) for i, (b, d) in enumerate(zip(self.running, next_logprobs))
                        for tok, e in d.items() if e.logprob != -math.inf),  # -inf: a grammar's disallowed token
                       key=lambda c: -c[0])[:self.num_top]
        gen_len = self.step + 1
        at_limit = gen_len >= self.max_tokens
        running = []
        for rank, (total, i, tok) in enumerate(cands):
            parent, entry = self.running[i], next_logprobs[i]
            hits = at_limit or tok in self.eos
            beam = None
            if hits and rank < width or not hits and len(running) < width:
                beam = _Beam(parent.tokens + [tok], parent.logprobs + [entry], total)
            if hits and rank < width:
                self.finished.append((total / gen_len ** lp, beam, "stop" if tok in self.eos else "length"))
            elif beam is not None:
                running.append(beam)
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[width:]
        self.running = running
        self.step = gen_len
        full = len(self.finished) == width
        if full and self.improvable and running:
            length = self.max_tokens if self.params.early_stopping == "never" and lp > 0 else gen_len
            self.improvable = running[0].cum_logprob / length ** lp > self.finished[-1][0]
        self.done = at_limit or not running or not self.improvable or (full and self.params.early_stopping is True)

    def result(self, eos_token_id: int | None) -> BeamSearchOutput:
        seqs = []
        for score, beam, reason in self.finished:
            last = beam.tokens[-1]
            stop_reason = None if reason != "stop" or last == eos_token_id else last
            seqs.append(BeamSearchSequence(self.prompt + beam.tokens, beam.logprobs, beam.cum_logprob, score,
                                           finish_reason=reason, stop_reason=stop_reason))
        return BeamSearchOutput(seqs)


def start_searches(processor, prompts: list[str | list[int]], params: BeamSearchParams) -> list[BeamSearch]:
    """One search per prompt (ValueError for a prompt that leaves no room to generate). processor: an
    InputProcessor or an LLMEngine (tokenize, max_model_len, stop_token_ids, model_config)."""
    searches = []
    for p in prompts:
        ids = processor.tokenize(p)
        room = processor.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room to generate within "
                             f"--max-model-len {processor.max_model_len}")
        searches.append(BeamSearch(ids, params, processor.stop_token_ids, min(params.max_tokens, room)))
    vocab = processor.model_config.vocab_size
    if searches and searches[0].num_top > vocab:
        raise ValueError(f"beam_width {params.beam_width} is too large for a vocabulary of {vocab} tokens")
    return searches


def step_params(searches: list[BeamSearch]):
    """Each step's requests' SamplingParams, one per pending() sequence: one greedy token with the top-K logprobs the
    search ranks (EOS is not a stop here: the search decides what an EOS ends); under a structured output each beam's
    grammar after its tokens (EOS then ends the grammar, as the search's stop)."""
    from vserve.core.sampling_params import SamplingParams

    so = searches[0].params.structured_outputs if searches else None
    if so is None:
        return [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=searches[0].num_top)] * sum(
            len(s.running) for s in searches if not s.done)
    return [SamplingParams(temperature=0, max_tokens=1, logprobs=s.num_top,
                           structured_outputs=replace(so, beam_prefix=tuple(b.tokens)))
            for s in searches if not s.done for b in s.running]


def advance_all(searches: list[BeamSearch], outs: list) -> None:
    """Give each search its beams' next-token logprobs from the step's outputs (in pending() order)."""
    at = 0
    for s in searches:
        n = len(s.pending())
        if n:
            s.advance([o.outputs[0].logprobs[0] for o in outs[at:at + n]])
            at += n


def finish_searches(processor, searches: list[BeamSearch]) -> list[BeamSearchOutput]:
    results = [s.result(processor.eos_token_id) for s in searches]
    if processor.tokenizer is not None:
        for r in results:
            for seq in r.sequences:
                seq.text = processor.tokenizer.decode(seq.tokens, skip_special_tokens=True)
    return results


def run_beam_search(llm, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """`LLM.beam_search`: all prompts' searches advance together, each step one batch of one-token requests."""
    from vserve.core.llm import _unpack

    engine = llm.llm_engine
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    searches = start_searches(engine, [_unpack(p)[0] for p in prompts], params)
    while batch := [seq for s in searches for seq in s.pending()]:
        advance_all(searches, llm.generate(batch, step_params(searches), use_tqdm=False))
    return finish_searches(engine, searches)
