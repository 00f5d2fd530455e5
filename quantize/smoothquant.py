"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights with per-input-channel scales
s = max|X|^alpha / max|W|^(1 - alpha), so that X / s and W * s are both easy to quantize to 8 bits; alpha fixed,
or searched per group of linears ("auto", as Intel Neural Compressor's auto alpha)."""

import torch

from vserve.quantize.w8a8 import dequantize_weight, fake_quantize_activation, quantize_weight

ALPHAS = tuple(k / 20 for k in range(21))  # the auto search's grid: 0, 0.05, ..., 1


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """Scales [in] for the weights sharing an input whose per-channel max |x| over calibration is act_absmax.
    The caller folds 1/s into the preceding norm (or linear) and s into the weights' input channels."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--smoothquant-alpha must be in [0, 1], got {alpha}")
    w_absmax = torch.cat([w.float() for w in weights], dim=0).abs().amax(dim=0)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def w8a8_output(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, kind: str) -> torch.Tensor:
    """What a W8A8 GEMM of x [tokens, in] and w [out, in] computes once smoothed by s: x / s quantized per token
    times w * s rounded to nearest per output channel."""
    return fake_quantize_activation(x.float() / s, kind) @ dequantize_weight(*quantize_weight(w * s, kind)).t()


def search_alpha(x: torch.Tensor, weights: list[torch.Tensor], kind: str, act_absmax: torch.Tensor | None = None,
                 alphas: tuple[float, ...] = ALPHAS) -> tuple[torch.Tensor, float | None]:
    """The smoothing of the weights sharing input x [..., in], among smooth_scales(act_absmax, weights, alpha) for
    each alpha of the grid and none at all (s = 1), whose W8A8 output (w8a8_output, the weights stacked) on x has
    the least squared error against the float x @ W^T. act_absmax: per-channel max |x| over all the calibration
    tokens (default: over x). Returns (s, alpha); alpha None when no smoothing is best (a tie goes to it)."""
    x = x.reshape(-1, x.shape[-1]).float()
    if act_absmax is None:
        act_absmax = x.abs().amax(dim=0)
    w = torch.cat([w.float() for w in weights], dim=0)  # the group's outputs side by side
    ref = x @ w.t()

    def error(s: torch.Tensor) -> float:
        return (w8a8_output(x, w, s, kind) - ref).pow(2).sum().item()

    s_best, alpha_best = torch.ones(x.shape[-1], device=x.device), None
    err_best = error(s_best)
    for alpha in alphas:
        s = smooth_scales(act_absmax, weights, alpha)
        err = error(s)
        if err < err_best:
            s_best, alpha_best, err_best = s, alpha, err
    return s_best, alpha_best
