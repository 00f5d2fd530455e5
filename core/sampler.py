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


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


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


def top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top_k (0 = off), top_p (1 = off) and min_p (0 = off) exclude, row-wise."""
    V = logits.shape[1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, _ = logits.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k, V).clamp(max=V)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
        if bool((top_p < 1).any()):
            probs = sorted_logits.masked_fill(sorted_logits < kth, float("-inf")).softmax(-1)
            # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
            cum_before = probs.cumsum(-1) - probs
            keep = cum_before < top_p.unsqueeze(1)
            keep[:, 0] = True
            cutoff = sorted_logits.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator: torch.Generator | None = None
        self.seed = seed

    def _global_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        want_logprobs = [r.sampling_params.logprobs is not None for r in reqs]
        raw_logprobs = logits.log_softmax(-1) if any(want_logprobs) else None
        logits = logits.clone()
        apply_penalties(logits, reqs)

        params = [r.sampling_params for r in reqs]
        greedy = torch.tensor([sp.greedy for sp in params], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            temp = torch.tensor([sp.temperature if not sp.greedy else 1.0 for sp in params],
                                device=logits.device, dtype=logits.dtype)
            scaled = logits / temp.unsqueeze(1)
            scaled = top_k_top_p_min_p(
                scaled,
                torch.tensor([sp.top_k for sp in params], device=logits.device),
                torch.tensor([sp.top_p for sp in params], device=logits.device, dtype=logits.dtype),
                torch.tensor([sp.min_p for sp in params], device=logits.device, dtype=logits.dtype),
            )
            probs = scaled.softmax(-1)
            # Inverse-CDF draw: one uniform per row, from the request's own generator when seeded (so its
            # tokens do not depend on the batch), else from the engine's; (0, 1] so a zero-mass token at the
            # start is never picked.
            u = torch.empty(len(reqs), device=logits.device, dtype=probs.dtype)
            glob = self._global_generator(logits.device)
            free = [i for i, r in enumerate(reqs) if r.generator is None]
            if free:
                u[free] = torch.rand(len(free), generator=glob, device=logits.device, dtype=probs.dtype)
            seeded = [i for i, r in enumerate(reqs) if r.generator is not None]
            if seeded:  # per-request generators live on the CPU: one draw each, one copy for all
                draws = torch.cat([torch.rand(1, generator=reqs[i].generator) for i in seeded])
                u[seeded] = draws.to(device=logits.device, dtype=probs.dtype)
            cdf = probs.cumsum(-1)
            target = ((1.0 - u) * cdf[:, -1]).unsqueeze(1)
            sampled = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)
            tokens = torch.where(greedy, tokens, sampled)
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw_logprobs, token_ids, params))

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
