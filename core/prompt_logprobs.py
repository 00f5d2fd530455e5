"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's log-softmax under the tokens before it,
computed in the prefill pass from the hidden states of the step that runs that part of the prompt.

Position p's logits score prompt token p + 1, so a prefill chunk over positions [s, s + n) scores tokens s + 1 ..
s + n (the last prompt position scores the first output token instead, which the sampler does). Logits are made a
slice of rows at a time and reduced on the device to the prompt token's logprob and rank and the top-N: no
full-vocabulary logits outlive a slice. A request keeps its chunks' small tensors until its first output token
carries them to the front end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vserve.core.messages import Logprob
from vserve.core.request import Request

_SLICE_ELEMENTS = 1 << 24  # logits elements made at once (64 MiB of float32)


@dataclass
class PromptLogprobsPlan:
    """Which of a step's token rows score a prompt token, and that token: what every TP rank needs to run it."""

    rows: torch.Tensor  # [m] token indexes in the step's flattened input
    targets: torch.Tensor  # [m] the prompt token each row scores
    num_top: int  # the largest prompt_logprobs asked in the step


def plan_step(reqs: list[Request], starts: list[int], nums: list[int]) -> tuple[PromptLogprobsPlan | None, list]:
    """(the rows to score, [(request, first position, count)]) for the requests of a step that asked for prompt
    logprobs; positions already scored (a request recomputed after preemption) are skipped."""
    offset, rows, targets, segments, num_top = 0, [], [], [], 0
    for r, s, n in zip(reqs, starts, nums):
        k = r.sampling_params.prompt_logprobs
        if k is not None:
            first = max(s, r.num_prompt_logprobs)
            end = min(s + n, r.num_prompt_tokens - 1)
            if end > first:
                rows.append(np.arange(offset + first - s, offset + end - s))
                targets.append(np.asarray(r.prompt_token_ids[first + 1:end + 1], dtype=np.int64))
                segments.append((r, first, end - first))
                num_top = max(num_top, k)
        offset += n
    if not segments:
        return None, []
    return PromptLogprobsPlan(torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(targets)),
                              num_top), segments


def score(model, hidden: torch.Tensor, plan: PromptLogprobsPlan) -> tuple[torch.Tensor, ...]:
    """(the target's logprob, its rank (1 = most likely), the top-N logprobs and ids) per planned row, on the
    device; the logits of at most _SLICE_ELEMENTS elements exist at once."""
    rows, targets = plan.rows.to(hidden.device), plan.targets.to(hidden.device)
    vocab = model.config.vocab_size
    per = max(1, _SLICE_ELEMENTS // vocab)
    parts = []
    for a in range(0, rows.numel(), per):
        lp = model.compute_logits(hidden[rows[a:a + per]]).float().log_softmax(-1)
        chosen = lp.gather(1, targets[a:a + per].unsqueeze(1))
        rank = (lp > chosen).sum(-1) + 1
        vals, ids = lp.topk(plan.num_top, dim=-1) if plan.num_top else (lp[:, :0], lp[:, :0].long())
        parts.append((chosen.squeeze(1), rank, vals, ids))
    return tuple(torch.cat(x) for x in zip(*parts))


def keep(segments: list, scored: tuple[torch.Tensor, ...]) -> None:
    """Each request keeps its rows of the step's scores (device tensors: nothing is read back here)."""
    a = 0
    for req, first, count in segments:
        if req.prompt_logprob_parts is None:
            req.prompt_logprob_parts = []
        req.prompt_logprob_parts.append((first, tuple(t[a:a + count] for t in scored)))
        req.num_prompt_logprobs = first + count
        a += count


def take(req: Request) -> list[dict[int, Logprob] | None] | None:
    """The request's prompt logprobs as vLLM gives them (None for the first token) with its first output token;
    None after that."""
    if req.num_output_tokens != 1:
        return None
    parts, req.prompt_logprob_parts = req.prompt_logprob_parts or [], None
    n = req.sampling_params.prompt_logprobs
    out: list[dict[int, Logprob] | None] = [None]
    ids = req.prompt_token_ids
    for first, tensors in sorted(parts, key=lambda p: p[0]):
        chosen, rank, vals, top = (t.tolist() for t in tensors)
        for j in range(len(chosen)):
            tok = ids[first + 1 + j]
            entry = {tok: Logprob(chosen[j], rank[j])}
            for r in range(n):
                if top[j][r] != tok:
                    entry[top[j][r]] = Logprob(vals[j][r], r + 1)
            out.append(entry)
    assert len(out) == len(ids), "every prompt position was scored once"
    return out
