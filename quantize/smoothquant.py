"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights with per-input-channel scales
s = max|X|^alpha / max|W|^(1 - alpha), so that X / s and W * s are both easy to quantize to 8 bits."""

import torch


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """Scales [in] for the weights sharing an input whose per-channel max |x| over calibration is act_absmax.
    The caller folds 1/s into the preceding norm (or linear) and s into the weights' input channels."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--smoothquant-alpha must be in [0, 1], got {alpha}")
    w_absmax = torch.cat([w.float() for w in weights], dim=0).abs().amax(dim=0)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)
