"""Sampler: logits of the rows that sample this step -> next tokens (+ logprobs), per-request params.

Processing order: logit_bias, min_tokens (stop tokens masked), repetition penalty over prompt and output
tokens (positive logits divided, negative multiplied), frequency and presence penalties over output
tokens, then greedy argmax (temperature 0) or temperature, top_k, top_p, min_p and an inverse-CDF draw. A request with
a seed draws from its own generator, so its tokens do not depend on what else is in the batch.
Logprobs are the log-softmax of the raw model logits (before any processing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vserve.core.request import Request
from vserve.kernels import for_device


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


@dataclass
class SampledTokens:
    """A step's sampled tokens still on the device. On CUDA their copy to pinned host memory is queued right
    behind the sampling kernels, so resolve() waits for this step only, not for a step launched after it."""

    tokens: torch.Tensor  # [rows] on the logits' device
    raw_logprobs: torch.Tensor | None
    params: list
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None

    def resolve(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
            token_ids = self.host.tolist()
        else:
            token_ids = self.tokens.tolist()
        return SamplerOutput(token_ids, Sampler._logprobs(self.raw_logprobs, token_ids, self.params))


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


class Sampler:
    """Samples on the logits' device. Which filters run is decided from the requests' parameters on the host,
    so a step reads nothing back from the GPU but the sampled tokens (one copy at the end)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator: torch.Generator | None = None
        self.seed = seed

    def _global_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    @staticmethod
    def _column(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        return self.sample(logits, reqs).resolve()

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> SampledTokens:
        """Launch the sampling of one step; nothing waits for the device."""
        params = [r.sampling_params for r in reqs]
        dev = logits.device
        raw_logprobs = logits.log_softmax(-1) if any(sp.logprobs is not None for sp in params) else None
        if any(sp.needs_logit_processing for sp in params):
            logits = logits.clone()
            apply_penalties(logits, reqs)

        greedy = [sp.greedy for sp in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            temps = [1.0 if g else sp.temperature for g, sp in zip(greedy, params)]
            scaled = logits
            if any(t != 1.0 for t in temps):
                scaled = logits / self._column(temps, dev, logits.dtype).unsqueeze(1)
            top_k = [0 if g else sp.top_k for g, sp in zip(greedy, params)]
            top_p = [1.0 if g else sp.top_p for g, sp in zip(greedy, params)]
            min_p = [0.0 if g else sp.min_p for g, sp in zip(greedy, params)]
            scaled = top_k_top_p_min_p(
                scaled,
                self._column(top_k, dev, torch.long) if any(k > 0 for k in top_k) else None,
                self._column(top_p, dev, logits.dtype) if any(p < 1 for p in top_p) else None,
                self._column(min_p, dev, logits.dtype) if any(m > 0 for m in min_p) else None,
            )
            # Inverse-CDF draw (sample_from_logits: one Triton kernel on CUDA): one uniform u in [0, 1) per row,
            # from the request's own generator when seeded (so its tokens do not depend on the batch), else from
            # the engine's; the target (1 - u) * total is in (0, total] and a zero-mass token is never drawn.
            glob = self._global_generator(dev)
            seeded = [i for i, r in enumerate(reqs) if r.generator is not None]
            if not seeded:
                u = torch.rand(len(reqs), generator=glob, device=dev, dtype=scaled.dtype)
            else:
                u = torch.empty(len(reqs), device=dev, dtype=scaled.dtype)
                free = [i for i, r in enumerate(reqs) if r.generator is None]
                if free:
                    u[free] = torch.rand(len(free), generator=glob, device=dev, dtype=scaled.dtype)
                # per-request generators live on the CPU: one draw each, one copy for all
                draws = torch.cat([torch.rand(1, generator=reqs[i].generator) for i in seeded])
                u[seeded] = draws.to(device=dev, dtype=scaled.dtype)
            tokens = for_device(scaled).sample_from_logits(scaled, u)
            if any(greedy):
                tokens = torch.where(self._column(greedy, dev, torch.bool), logits.argmax(dim=-1), tokens)
        out = SampledTokens(tokens, raw_logprobs, params)
        if dev.type == "cuda":
            out.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            out.host.copy_(tokens, non_blocking=True)
            out.event = torch.cuda.Event()
            out.event.record()
        return out

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, token_ids: list[int], params) -> list:
        if raw is None:
            return [None] * len(token_ids)
        out = []
        for i, sp in enumerate(params):
            if sp.logprobs is None:
                out.append(None)
                continue
            row = raw[i]
            chosen = token_ids[i]
            chosen_lp = row[chosen]
            rank = int((row > chosen_lp).sum()) + 1
            entry = {chosen: Logprob(float(chosen_lp), rank)}
            if sp.logprobs:
                vals, idx = row.topk(sp.logprobs)
                for r, (v, t) in enumerate(zip(vals.tolist(), idx.tolist())):
                    if t != chosen:
                        entry[t] = Logprob(v, r + 1)
            out.append(entry)
        return out
