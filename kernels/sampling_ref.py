"""Pure-torch reference for the sampling kernel (the CPU path and the oracle for kernels/triton_sampling.py)."""

from __future__ import annotations

import torch


def sample_from_logits_ref(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row of softmax(logits): logits [B, V] (masked entries -inf), u [B] uniform in
    [0, 1) -> tokens [B] int64.

    In float32 (float64 for float64 logits): the token is the first index whose inclusive prefix sum of the
    probabilities reaches (1 - u) * total (the last index if rounding leaves the target above every prefix), then
    the zero-mass rule: the last index with nonzero probability at or before it, so a masked token is never drawn.
    A row without mass (all -inf; the filters never produce one) gives 0. For float32 logits this is the
    sampler's former softmax/cumsum/searchsorted draw, token for token: a sequential cumsum never crosses the
    target on a zero-mass token, so the rule acts only on a parallel (CUDA) cumsum's rounding.
    """
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
    cdf = probs.cumsum(-1)
    target = ((1.0 - u.to(probs.dtype)) * cdf[:, -1]).unsqueeze(1)
    first = torch.searchsorted(cdf, target).clamp_(max=probs.shape[1] - 1)
    cols = torch.arange(probs.shape[1], device=probs.device)
    return torch.where((probs > 0) & (cols <= first), cols, -1).amax(-1).clamp_(min=0)


def cdf_boundary_ties(logits: torch.Tensor, u: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      rtol: float) -> torch.Tensor:
    """Per row, whether tokens a and b [B] are the same draw up to float summation order: every float64 prefix
    sum of softmax(logits) from min(a, b) to max(a, b) - 1 lies within rtol * total of the target (1 - u) *
    total, i.e. the target sat on a CDF boundary that fp32 sums may place on either side. True where a == b."""
    cdf = logits.double().softmax(-1).cumsum(-1)
    target = ((1.0 - u.double()) * cdf[:, -1]).unsqueeze(1)
    cols = torch.arange(cdf.shape[1], device=cdf.device)
    between = (cols >= torch.minimum(a, b).unsqueeze(1)) & (cols < torch.maximum(a, b).unsqueeze(1))
    return (torch.where(between, (cdf - target).abs(), 0.0).amax(-1) <= rtol * cdf[:, -1]) | (a == b)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: for each j, logits[rows[j], t] = -inf where bit t % 32 of bitmask[j, t // 32] is 0 (xgrammar's
    layout: int32 words, bit 1 = allowed). Other rows are untouched; columns past the bitmask's 32 * W are masked."""
    V = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if allowed.shape[1] < V:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], V - allowed.shape[1])], 1)
    sub = logits.index_select(0, rows).masked_fill_(~allowed[:, :V].to(logits.device), float("-inf"))
    logits.index_copy_(0, rows, sub)
