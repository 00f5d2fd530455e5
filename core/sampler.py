"""Sampler: logits of the rows that sample this step -> next tokens (+ logprobs), per-request params.

Processing order: logit_bias, min_tokens (stop tokens masked), repetition penalty over prompt and output
tokens (positive logits divided, negative multiplied), frequency and presence penalties over output
tokens, then greedy argmax (temperature 0) or temperature, top_k, top_p, min_p and an inverse-CDF draw. A request with
a seed draws from its own generator, so its tokens do not depend on what else is in the batch.
Logprobs are the log-softmax of the raw model logits (before any processing).

Every kind of work runs once for the whole batch on the logits' device: the penalties read per-request token counts
kept on the device (TokenCounts, updated with each step's sampled tokens), logprobs are gathered for all the rows
that want them and copied back with the tokens. So a request with penalties or logprobs needs nothing from the host
that the step in flight has not yet delivered, and async scheduling stays on. `apply_penalties` is the per-row
reference of `apply_penalties_batched`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from vserve.core.messages import CompactLogprobs
from vserve.core.request import Request
from vserve.kernels import for_device


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[CompactLogprobs | None]  # per row, for the rows that want them (messages.logprobs_dict)


@dataclass
class SampledTokens:
    """A step's sampled tokens (and the logprob rows' chosen logprob, rank and top-N) still on the device. On CUDA
    their copy to pinned host memory is queued right behind the sampling kernels, so resolve() waits for this step
    only, not for a step launched after it: a step with logprobs keeps async scheduling on."""

    tokens: torch.Tensor  # [rows] on the logits' device
    params: list
    lp_rows: list[int]  # the rows that want logprobs
    lp: tuple[torch.Tensor, ...] = ()  # (chosen logprob, rank, top-N values, top-N ids) of those rows
    host: tuple[torch.Tensor, ...] | None = None
    event: torch.cuda.Event | None = None

    def copy_to_host(self) -> None:
        tensors = (self.tokens, *self.lp)
        self.host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
        for h, t in zip(self.host, tensors):
            h.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def resolve(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        tokens, *lp = self.host if self.host is not None else (self.tokens, *self.lp)
        token_ids = tokens.tolist()
        logprobs: list[CompactLogprobs | None] = [None] * len(token_ids)
        if self.lp_rows:
            chosen, rank, top_vals, top_ids = (t.tolist() for t in lp)
            for j, i in enumerate(self.lp_rows):
                tok, n = token_ids[i], self.params[i].logprobs
                ids, vals = top_ids[j][:n], top_vals[j][:n]
                ranks = list(range(1, n + 1))
                if tok in ids:  # the sampled token comes first, once
                    at = ids.index(tok)
                    del ids[at], vals[at], ranks[at]
                logprobs[i] = ([tok, *ids], [chosen[j], *vals], [rank[j], *ranks])
        return SamplerOutput(token_ids, logprobs)


def column(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device: on CUDA through pinned memory, copied behind
    the work already queued. (`torch.tensor(values, device=cuda)` copies from pageable memory, which first waits
    for the stream: in the step path that stalls the host until the forward in flight ends, and async scheduling
    gains nothing.)"""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def batched_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], params: list,
                     allowed: tuple[list[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """For `rows`: (the sampled token's log-softmax, its rank (1 = most likely), the top-N log-softmax values and
    ids with N the largest asked), from the raw logits, as device tensors: nothing is read back here. allowed:
    (positions in `rows`, their allowed-token masks): those rows' top N are taken among the allowed tokens only
    (beam search under a grammar), a disallowed one filling the list at -inf where fewer are allowed."""
    idx = column(rows, logits.device, torch.long) if len(rows) < logits.shape[0] else None
    raw = (logits if idx is None else logits.index_select(0, idx)).log_softmax(-1)
    chosen = raw.gather(1, (tokens if idx is None else tokens.index_select(0, idx)).unsqueeze(1))
    rank = (raw > chosen).sum(-1) + 1
    k = max(params[i].logprobs for i in rows)
    top = raw
    if allowed is not None:
        at, ok = allowed
        at = column(at, raw.device, torch.long)
        top = raw.index_put((at,), raw.index_select(0, at).masked_fill(~ok, float("-inf")))
    vals, ids = top.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
    return chosen.squeeze(1), rank, vals, ids


class TokenCounts:
    """Per-request device rows for the repetition, frequency and presence penalties: each output token's count and
    a mask of the prompt's tokens. The sampler adds each step's sampled tokens on the device, so the next step
    sees the token still in flight (async scheduling stays on) without reading anything back."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.rows: dict[str, int] = {}  # request id -> its row
        self.num_counted: dict[str, int] = {}  # request id -> output tokens its row holds
        self.free: list[int] = []

    def row_of(self, req: Request) -> int:
        """The request's row, (re)built from its host token lists when they are not what the row holds."""
        rid = req.request_id
        row = self.rows.get(rid)
        known = req.num_output_tokens + req.num_pending
        if row is not None and self.num_counted[rid] == known:
            return row
        if row is None:
            if not self.free:
                self._grow()
            row = self.rows[rid] = self.free.pop()
        # New, or counted tokens that were not sampled here (set by hand): the host lists are complete then.
        self.counts[row].zero_()
        self.prompt[row].zero_()
        self.prompt[row, column(req.prompt_token_ids, self.device, torch.long)] = True
        if req.output_token_ids:
            out = column(req.output_token_ids, self.device, torch.long)
            self.counts[row] = torch.bincount(out, minlength=self.vocab)[:self.vocab].to(torch.int32)
        self.num_counted[rid] = req.num_output_tokens
        return row

    def _grow(self) -> None:
        n = self.counts.shape[0]
        m = max(8, 2 * n)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(m - n, self.vocab)])
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(m - n, self.vocab)])
        self.free += range(m - 1, n - 1, -1)

    def add(self, rows: torch.Tensor, tokens: torch.Tensor, request_ids: list[str]) -> None:
        """Count one sampled token per row (on the device)."""
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        for rid in request_ids:
            self.num_counted[rid] += 1

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            del self.num_counted[request_id]
            self.free.append(row)


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place, row i for reqs[i]: logit_bias, min_tokens, repetition/frequency/presence penalties."""
    V = logits.shape[1]
    for i, req in enumerate(reqs):
        sp = req.sampling_params
        if not sp.needs_logit_processing:
            continue
        row = logits[i]
        if sp.logit_bias:
            ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=row.device)
            row.index_add_(0, ids, torch.tensor(list(sp.logit_bias.values()), dtype=row.dtype, device=row.device))
        if req.num_output_tokens < sp.min_tokens and sp.all_stop_token_ids:
            row[list(sp.all_stop_token_ids)] = float("-inf")
        if sp.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool, device=row.device)
            seen[torch.tensor(req.all_token_ids, dtype=torch.long, device=row.device)] = True
            pen = torch.where(row > 0, row / sp.repetition_penalty, row * sp.repetition_penalty)
            row.copy_(torch.where(seen, pen, row))
        if (sp.frequency_penalty or sp.presence_penalty) and req.output_token_ids:
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(out, minlength=V)[:V].to(row.dtype)
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)


def apply_penalties_batched(logits: torch.Tensor, reqs: list[Request],
                            counts: TokenCounts) -> tuple[torch.Tensor, list[int], list[str]] | None:
    """apply_penalties with each kind of work done once for the whole batch: logit_bias and min_tokens as one
    scatter each, the penalties over the TokenCounts rows of the requests that have them. min_tokens counts the
    token in flight (num_pending). Returns what to count after sampling: (the penalty rows' TokenCounts rows, their
    batch rows, their request ids), or None."""
    rows = [i for i, r in enumerate(reqs) if r.sampling_params.needs_logit_processing]
    bias_r, bias_t, bias_v, min_r, min_t, pen = [], [], [], [], [], []
    for i in rows:
        req = reqs[i]
        sp = req.sampling_params
        for t, v in (sp.logit_bias or {}).items():
            bias_r.append(i)
            bias_t.append(t)
            bias_v.append(v)
        if req.num_output_tokens + req.num_pending < sp.min_tokens:
            for t in sp.all_stop_token_ids:
                min_r.append(i)
                min_t.append(t)
        if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
            pen.append(i)
    dev, dtype = logits.device, logits.dtype
    if bias_r:
        logits.index_put_((column(bias_r, dev, torch.long), column(bias_t, dev, torch.long)),
                          column(bias_v, dev, dtype), accumulate=True)
    if min_r:
        logits[column(min_r, dev, torch.long), column(min_t, dev, torch.long)] = float("-inf")
    if not pen:
        return None
    sps = [reqs[i].sampling_params for i in pen]
    slots = column([counts.row_of(reqs[i]) for i in pen], dev, torch.long)
    batch_rows = column(pen, dev, torch.long)
    sub = logits.index_select(0, batch_rows)
    c = counts.counts.index_select(0, slots)
    rp = column([sp.repetition_penalty for sp in sps], dev, dtype).unsqueeze(1)
    seen = counts.prompt.index_select(0, slots) | (c > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
    cf = c.to(dtype)
    fp = column([sp.frequency_penalty for sp in sps], dev, dtype).unsqueeze(1)
    pp = column([sp.presence_penalty for sp in sps], dev, dtype).unsqueeze(1)
    sub -= fp * cf + pp * (cf > 0).to(dtype)
    logits.index_copy_(0, batch_rows, sub)
    return slots, pen, [reqs[i].request_id for i in pen]


def top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what top_k (0 = off), top_p (1 = off) and min_p (0 = off) exclude, row-wise.

    A None argument means the filter is off for every row (the caller knows from the requests' parameters, so
    no device tensor is read back to find out)."""
    V = logits.shape[1]
    if top_k is not None or top_p is not None:
        sorted_logits, _ = logits.sort(dim=-1, descending=True)
        if top_k is not None:
            k = torch.where(top_k > 0, top_k, V).clamp(max=V)
            kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if top_p is not None:
            probs = sorted_logits.softmax(-1)
            # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
            cum_before = probs.cumsum(-1) - probs
            keep = cum_before < top_p.unsqueeze(1)
            keep[:, 0] = True
            cutoff = sorted_logits.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
    if min_p is not None:
        probs = logits.softmax(-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def same_requests(a: list[Request], b: list[Request]) -> bool:
    """The same request objects in the same order (by identity: a C-level pass, ~5 us at 256 rows)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


class SamplingPlan:
    """What the sampler decides from a batch's sampling parameters alone (rows, filters, their device columns).
    A request's parameters and generator never change, so a plan holds while a step samples the same requests in
    the same order, as a decode step usually does: the sampler builds it when the batch changes, not every step
    (at 256 rows its ~14 passes over the rows were ~170 us of host time a step on this project's CPU)."""

    def __init__(self, reqs: list[Request], dev: torch.device, dtype: torch.dtype) -> None:
        self.reqs = reqs
        self.params = params = [r.sampling_params for r in reqs]
        self.dev, self.dtype = dev, dtype
        self.needs_processing = any(sp.needs_logit_processing for sp in params)
        greedy = [sp.greedy for sp in params]
        self.all_greedy = all(greedy)
        # rows drawn (not greedy): temperature, top-k/p, min-p as device columns, each None when off for every row
        self.temps = self.top_k = self.top_p = self.min_p = self.greedy_rows = None
        if not self.all_greedy:
            temps = [1.0 if g else sp.temperature for g, sp in zip(greedy, params)]
            top_k = [0 if g else sp.top_k for g, sp in zip(greedy, params)]
            top_p = [1.0 if g else sp.top_p for g, sp in zip(greedy, params)]
            min_p = [0.0 if g else sp.min_p for g, sp in zip(greedy, params)]
            if any(t != 1.0 for t in temps):
                self.temps = column(temps, dev, dtype).unsqueeze(1)
            if any(k > 0 for k in top_k):
                self.top_k = column(top_k, dev, torch.long)
            if any(p < 1 for p in top_p):
                self.top_p = column(top_p, dev, dtype)
            if any(m > 0 for m in min_p):
                self.min_p = column(min_p, dev, dtype)
            if any(greedy):
                self.greedy_rows = column(greedy, dev, torch.bool)
        self.seeded = [i for i, r in enumerate(reqs) if r.generator is not None]  # their own generators (CPU)
        self.unseeded = [i for i, r in enumerate(reqs) if r.generator is None] if self.seeded else None
        self.lp_rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]

    def fits(self, reqs: list[Request], dev: torch.device, dtype: torch.dtype) -> bool:
        return self.dev == dev and self.dtype == dtype and same_requests(reqs, self.reqs)


class Sampler:
    """Samples on the logits' device. Which filters run is decided from the requests' parameters on the host
    (a SamplingPlan, kept while the batch is unchanged), so a step reads nothing back from the GPU but the sampled
    tokens (one copy at the end)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator: torch.Generator | None = None
        self.seed = seed
        self.counts: TokenCounts | None = None  # made at the first request with a penalty
        self.plan: SamplingPlan | None = None  # the last batch's

    def release(self, request_id: str) -> None:
        """A finished request's penalty state goes back to the pool."""
        if self.counts is not None:
            self.counts.release(request_id)

    def _global_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        return self.sample(logits, reqs).resolve()

    def sample(self, logits: torch.Tensor, reqs: list[Request],
               bitmask: tuple[torch.Tensor, list[int]] | None = None) -> SampledTokens:
        """Launch the sampling of one step; nothing waits for the device. bitmask: the structured-output rows'
        allowed tokens (host int32 words, core/structured_output.py) and their rows, applied first."""
        dev = logits.device
        plan = self.plan
        if plan is None or not plan.fits(reqs, dev, logits.dtype):
            plan = self.plan = SamplingPlan(reqs, dev, logits.dtype)
        raw = logits
        counted = None
        allowed = None  # beam search rows under a grammar: their top logprobs among the allowed tokens
        if bitmask is not None:
            mask, rows = bitmask
            logits = logits.clone()  # logprobs are of the raw logits
            # the host words go to the device behind the step's queue; the next fill waits for this step's tokens
            for_device(logits).apply_token_bitmask(logits, mask.to(dev, non_blocking=True),
                                                   column(rows, dev, torch.long))
            at = [j for j, i in enumerate(plan.lp_rows) if (g := reqs[i].grammar) is not None and g.allowed_logprobs]
            if at:
                masked = logits.index_select(0, column([plan.lp_rows[j] for j in at], dev, torch.long))
                allowed = (at, masked != float("-inf"))
        if plan.needs_processing:
            if logits is raw:
                logits = logits.clone()
            if self.counts is None or self.counts.vocab != logits.shape[1] or self.counts.device != dev:
                self.counts = TokenCounts(logits.shape[1], dev)
            counted = apply_penalties_batched(logits, reqs, self.counts)

        if plan.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            scaled = logits if plan.temps is None else logits / plan.temps
            scaled = top_k_top_p_min_p(scaled, plan.top_k, plan.top_p, plan.min_p)
            # Inverse-CDF draw (sample_from_logits: one Triton kernel on CUDA): one uniform u in [0, 1) per row,
            # from the request's own generator when seeded (so its tokens do not depend on the batch), else from
            # the engine's; the target (1 - u) * total is in (0, total] and a zero-mass token is never drawn.
            glob = self._global_generator(dev)
            if not plan.seeded:
                u = torch.rand(len(reqs), generator=glob, device=dev, dtype=scaled.dtype)
            else:
                u = torch.empty(len(reqs), device=dev, dtype=scaled.dtype)
                if plan.unseeded:
                    u[plan.unseeded] = torch.rand(len(plan.unseeded), generator=glob, device=dev, dtype=scaled.dtype)
                # per-request generators live on the CPU: one draw each, one copy for all
                draws = torch.cat([torch.rand(1, generator=reqs[i].generator) for i in plan.seeded])
                u[plan.seeded] = draws.to(device=dev, dtype=scaled.dtype)
            tokens = for_device(scaled).sample_from_logits(scaled, u)
            if plan.greedy_rows is not None:
                tokens = torch.where(plan.greedy_rows, logits.argmax(dim=-1), tokens)
        if counted is not None:
            slots, rows, ids = counted
            self.counts.add(slots, tokens.index_select(0, column(rows, dev, torch.long)), ids)
        lp_rows = plan.lp_rows
        out = SampledTokens(tokens, plan.params, lp_rows,
                            batched_logprobs(raw, tokens, lp_rows, plan.params, allowed) if lp_rows else ())
        if dev.type == "cuda":
            out.copy_to_host()
        return out
