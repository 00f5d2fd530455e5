"""OutputProcessor: the front end's half of a step. The engine core sends each request's new token ids (and
logprobs); here they are detokenized incrementally, stop strings are found (the request is then aborted in the core),
and `RequestOutput`s are made: deltas for streams, or one cumulative output once a request finishes.

It runs in the caller's process (the API process for `serve`, the caller's for `LLM`), so with the core in its own
process the text work overlaps the device's step instead of delaying the next one.
"""

from __future__ import annotations

from vserve.core.detokenizer import IncrementalDetokenizer
from vserve.core.messages import CoreOutput, StepOutputs, logprobs_dict
from vserve.core.request import CompletionOutput, Request, RequestOutput


class RequestState:
    """One sequence as the front end sees it (n > 1: one per child)."""

    __slots__ = ("request", "detok", "token_ids", "logprobs", "cumulative_logprob", "num_sent", "text_sent",
                 "finish_reason", "stop_reason", "first_token_time", "scheduled_time", "num_cached_tokens",
                 "prompt_logprobs")

    def __init__(self, request: Request, tokenizer) -> None:
        self.request = request
        params = request.sampling_params
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params) if tokenizer else None
        self.token_ids: list[int] = []
        self.logprobs = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.num_sent = 0  # tokens already handed out as deltas
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.first_token_time: float | None = None
        self.scheduled_time: float | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list | None = None

    # what metrics read of a finished request
    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    def append(self, token_id: int, out: CoreOutput | None) -> bool:
        """Add the core's token (out: the row's CoreOutput when it carries more than the token); True when a stop
        string ended the request here (the core must abort it)."""
        self.token_ids.append(token_id)
        finish = None
        if out is not None:
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs
            if out.logprobs is not None:
                self.logprobs.append(logprobs_dict(out.logprobs))
                self.cumulative_logprob += out.logprobs[1][0]  # the sampled token's
            self.num_cached_tokens = out.num_cached_tokens
            finish = out.finish_reason
            if finish is not None:
                self.finish_reason, self.stop_reason = finish, out.stop_reason
                self.first_token_time, self.scheduled_time = out.first_token_time, out.scheduled_time
        params = self.request.sampling_params
        if self.detok is None or (finish == "stop" and token_id in params.all_stop_token_ids):
            return False  # a stop token's text is not shown (a completed grammar's last token is)
        stop_str = self.detok.update(token_id, check_stop=len(self.token_ids) >= params.min_tokens)
        if stop_str is None:
            return False
        self.finish_reason, self.stop_reason = "stop", stop_str
        return finish is None

    def completion(self, delta: bool) -> CompletionOutput:
        finished = self.finish_reason is not None
        if delta:
            start, self.num_sent = self.num_sent, len(self.token_ids)
            token_ids = self.token_ids[start:]
            lps = self.logprobs[start:] if self.logprobs is not None else None
            cum = sum(d[t].logprob for d, t in zip(lps, token_ids)) if lps is not None else None
            text = self.detok.new_text(finished) if self.detok else ""
        else:
            token_ids, lps, cum = self.token_ids, self.logprobs, self.cumulative_logprob
            text = self.detok.text(finished) if self.detok else ""
        return CompletionOutput(self.request.index, text, token_ids, cum, lps, self.finish_reason, self.stop_reason)


class OutputProcessor:
    """Request states by id; `process` turns one engine step's outputs into RequestOutputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by child request id
        self.parents: dict[str, list[RequestState]] = {}
        self.last_finished: dict[str, list[RequestState]] = {}  # parents finished in the last step -> children

    def add(self, children: list[Request]) -> None:
        parent_id = children[0].parent_id
        if parent_id in self.parents:
            raise ValueError(f"request id {parent_id!r} is already in use")
        states = [RequestState(r, self.tokenizer) for r in children]
        self.parents[parent_id] = states
        for s in states:
            self.states[s.request.request_id] = s

    def abort(self, parent_id: str) -> list[str]:
        """Forget a request; the ids of its children the core still runs (to abort there)."""
        states = self.parents.pop(parent_id, [])
        for s in states:
            self.states.pop(s.request.request_id, None)
        return [s.request.request_id for s in states if s.finish_reason is None]

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process(self, outputs: StepOutputs, delta: bool = False,
                finished_only: bool = False) -> tuple[list[RequestOutput], list[str]]:
        """(the outputs of the requests this step changed, or with finished_only of those it finished; the ids the
        core must abort because a stop string ended them here). Tokens of requests already finished or aborted
        here (the core ran them one step more) are dropped."""
        self.last_finished = {}
        changed: dict[str, None] = {}
        aborts = []
        states = self.states
        full = outputs.full
        for i, (rid, token) in enumerate(zip(outputs.request_ids, outputs.token_ids)):
            state = states.get(rid)
            if state is None or state.finish_reason is not None:
                continue
            if state.append(token, full.get(i)):
                aborts.append(rid)
            if not finished_only or state.finish_reason is not None:
                changed[state.request.parent_id] = None
        outs = [self._make_output(pid, delta) for pid in changed]
        return ([o for o in outs if o.finished] if finished_only else outs), aborts

    def _make_output(self, parent_id: str, delta: bool) -> RequestOutput:
        children = self.parents[parent_id]
        first = children[0]
        done = all(s.finish_reason is not None for s in children)
        out = RequestOutput(parent_id, first.request.prompt, first.request.prompt_token_ids,
                            [s.completion(delta) for s in children], done, num_cached_tokens=first.num_cached_tokens,
                            prompt_logprobs=first.prompt_logprobs)
        if done:
            self.last_finished[parent_id] = children
            del self.parents[parent_id]
            for s in children:
                del self.states[s.request.request_id]
        return out
