"""AWQ (Lin et al. 2023) for one linear, or several sharing an input (q/k/v, gate/up): search per-input-channel
scales that protect the channels with large activations, then search per-group clipping of the scaled weight."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vserve.quantize.rtn import fake_quantize, quantize_rtn


@dataclass(slots=True)
class AWQResult:
    """The scales to fold and the quantized, scaled weights.

    Fold: multiply each weight's input channels by `scales` (that is what `layers` quantizes) and divide the
    preceding norm's weight (or preceding linear's output rows) by `scales`, so the float model is unchanged."""

    scales: torch.Tensor  # [in] float32
    alpha: float
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per weight: (q, zeros, scales) as quantize_rtn


def search_scales(
    weights: list[torch.Tensor],
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    n_grid: int = 20,
    duo_scaling: bool = False,
    forward: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    act_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """Grid over alpha = 0, 1/n_grid, ..., (n_grid-1)/n_grid (AutoAWQ's grid; alpha = 0 is plain RTN):
    scales = s_x^alpha (duo_scaling, AutoAWQ's default: s_x^alpha / s_w^(1-alpha), s_w the mean of |w| relative to
    its group's max), normalized; keep the alpha whose fake-quantized (W * scales) / scales gives the smallest
    output MSE. The output is `forward(weights)`: by default x @ W^T of the weights concatenated; the caller can
    pass the block the weights sit in (attention, MLP) instead, as AutoAWQ does, in any dtype (the error is taken
    in float32). act_mean: s_x, the mean |x| per input channel, when x is not all the tokens. Returns (scales [in],
    alpha)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if forward is None:
        def forward(ws: list[torch.Tensor]) -> torch.Tensor:
            return x2 @ torch.cat(ws, dim=0).t()
    W = torch.cat([w.float() for w in weights], dim=0)
    ref = forward([w.float() for w in weights]).float()
    s_x = x2.abs().mean(dim=0) if act_mean is None else act_mean.float()
    wg = W.abs().reshape(W.shape[0], -1, group_size)
    s_w = (wg / (wg.amax(dim=-1, keepdim=True) + 1e-6)).reshape_as(W).mean(dim=0)
    best = (float("inf"), None, 0.0)
    for k in range(n_grid):
        alpha = k / n_grid
        s = s_x.pow(alpha) / (s_w.pow(1 - alpha) + 1e-4) if duo_scaling else s_x.pow(alpha)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre around 1 so neither W nor x is pushed far in range
        out = forward([fake_quantize(w.float() * s, bits, group_size) / s for w in weights])
        err = (out.float() - ref).pow(2).mean()
        if err.item() < best[0]:
            best = (err.item(), s, alpha)
    return best[1], best[2]


def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
) -> torch.Tensor:
    """Per (output row, group) max |w| in [max_shrink, 1] x the original that minimizes that group's partial
    output error sum_k x_k w_k after fake quantization. Returns max_val [out, in/group]."""
    out_features, n = w.shape
    x = x.reshape(-1, n).float()
    x = x[:: max(1, x.shape[0] // n_tokens)]  # a strided subset of tokens is enough for a per-group choice
    wg = w.float().reshape(out_features, -1, group_size)
    xg = x.reshape(x.shape[0], -1, group_size)
    ref = torch.einsum("ogk,tgk->otg", wg, xg)
    org_max = wg.abs().amax(dim=-1)
    best_err = torch.full_like(org_max, float("inf"))
    best_max = org_max.clone()
    for k in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - k / n_grid)
        cur = torch.maximum(torch.minimum(wg, max_val[..., None]), -max_val[..., None])
        q = fake_quantize(cur.reshape(out_features, n), bits, group_size).reshape_as(wg)
        err = (torch.einsum("ogk,tgk->otg", q, xg) - ref).pow(2).mean(dim=1)
        better = err < best_err
        best_err[better], best_max[better] = err[better], max_val[better]
    return best_max


def quantize_awq(
    weights: list[torch.Tensor],
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    n_grid: int = 20,
    duo_scaling: bool = False,
    forward: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    clip: list[bool] | None = None,
    scale_search: bool = True,
    act_mean: torch.Tensor | None = None,
) -> AWQResult:
    """Scale search over the weights sharing input x (skipped, scales 1, when nothing precedes them to fold into),
    then clipping (of the weights whose `clip` is true; all by default) and RTN of each scaled weight. x may be a
    subset of the tokens (clipping scores 512 of them) when act_mean gives the mean |x| over all of them."""
    if scale_search:
        s, alpha = search_scales(weights, x, bits, group_size, n_grid, duo_scaling, forward, act_mean)
    else:
        s, alpha = torch.ones(x.shape[-1], device=x.device), 0.0
    xs = x.reshape(-1, x.shape[-1]).float() / s
    layers = []
    for w, do_clip in zip(weights, clip or [True] * len(weights)):
        ws = w.float() * s
        if do_clip:
            max_val = search_clip(ws, xs, bits, group_size, n_grid).repeat_interleave(group_size, dim=1)
            ws = torch.maximum(torch.minimum(ws, max_val), -max_val)
        layers.append(quantize_rtn(ws, bits, group_size))
    return AWQResult(scales=s, alpha=alpha, layers=layers)
