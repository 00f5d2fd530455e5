"""GPTQ (Frantar et al. 2022) for one linear layer: quantize columns in order, pushing each column's error
onto the not-yet-quantized columns through the inverse Hessian of the layer's calibration inputs."""

import torch

from vserve.quantize.rtn import quant_params, quantize_codes


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X^T X / n for activations x [..., in]; dividing by n changes nothing (damping is relative)
    but keeps H's magnitude independent of how many calibration tokens there were."""
    x = x.reshape(-1, x.shape[-1]).double()
    return (2.0 / x.shape[0]) * x.t() @ x


def quantize_gptq(
    w: torch.Tensor,
    H: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    percdamp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    sym: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in], H [in, in] -> (q int32 [out, in], zeros int32 [out, in/group], scales float32 [out, in/group],
    g_idx int32 [in]). With act_order, columns are quantized by decreasing diag(H) and groups follow that order,
    so g_idx is then not monotonic. With sym, every zero is 2^(bits-1) (AutoGPTQ's symmetric grid)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    out_features, n = w.shape
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size must divide in_features ({n}), got {group_size}")
    if H.shape != (n, n):
        raise ValueError(f"H must be [{n}, {n}], got {tuple(H.shape)}")
    scales = torch.zeros(out_features, n // group_size, dtype=torch.float64, device=w.device)
    zeros = torch.zeros_like(scales)
    params: list[torch.Tensor] = []

    def round_column(col: int, w_col: torch.Tensor, upcoming) -> torch.Tensor:
        if col % group_size == 0:  # group parameters from the weights as updated so far
            params[:] = quant_params(upcoming(group_size), bits, sym)
            scales[:, col // group_size], zeros[:, col // group_size] = params
        scale, zero = params
        c = quantize_codes(w_col, scale, zero, bits)
        codes[:, col] = c
        return (c - zero) * scale

    codes = torch.zeros(out_features, n, dtype=torch.float64, device=w.device)
    perm = error_feedback(w, H, round_column, percdamp, block_size, act_order)
    invperm = torch.argsort(perm)
    g_idx = (torch.arange(n, device=w.device) // group_size)[invperm].to(torch.int32)
    return codes[:, invperm].to(torch.int32), zeros.to(torch.int32), scales.float(), g_idx


def error_feedback(w: torch.Tensor, H: torch.Tensor, round_column, percdamp: float = 0.01, block_size: int = 128,
                   act_order: bool = False) -> torch.Tensor:
    """GPTQ's sweep over the columns of w [out, in] (in float64): round_column(col, column, upcoming) returns the
    column as rounded (dequantized), upcoming(k) the k not yet rounded columns from col on as updated so far;
    each column's rounding error goes onto the later columns through the damped inverse Hessian. Returns the
    column order used (act_order: decreasing diag(H))."""
    n = w.shape[1]
    W = w.double().clone()
    H = H.double().clone()
    dead = torch.diag(H) == 0  # inputs that were always zero: their weights cannot matter
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(n, device=H.device)
    W, H = W[:, perm], H[perm][:, perm]
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(n, dtype=H.dtype, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            rounded = round_column(col, W1[:, i], lambda k, W1=W1, i=i, i2=i2: _columns(W1[:, i:], W[:, i2:], k))
            err = (W1[:, i] - rounded) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # the lazy update: later blocks see this block's error once
    return perm


def _columns(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """The first k columns of [a, b] (only those copied: b can be most of a large weight)."""
    return a[:, :k] if a.shape[1] >= k else torch.cat([a, b[:, :k - a.shape[1]]], dim=1)


def quantize_gptq_channel(w: torch.Tensor, H: torch.Tensor, kind: str, percdamp: float = 0.01,
                          block_size: int = 128, act_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit weights per output channel (as w8a8.quantize_weight: FP8 e4m3 or INT8, scale max|row| / qmax from
    the original weights) rounded with GPTQ's error feedback: w [out, in], H [in, in] -> (q [out, in]
    float8_e4m3fn or int8, scale float32 [out, 1]). act_order only changes the order the columns are rounded in
    (one scale per row: nothing to store for it)."""
    from vserve.quantize.w8a8 import quantize_weight, round_to_grid

    _, scale = quantize_weight(w, kind)
    q = torch.zeros(w.shape, dtype=torch.float32, device=w.device)  # in the sweep's column order, put back below
    s64 = scale.double()[:, 0]

    def round_column(col: int, w_col: torch.Tensor, upcoming) -> torch.Tensor:
        q[:, col] = round_to_grid((w_col / s64).float(), kind)
        return q[:, col].double() * s64

    perm = error_feedback(w, H, round_column, percdamp, block_size, act_order)
    q = q[:, torch.argsort(perm)]
    return q.to(torch.float8_e4m3fn if kind == "fp8" else torch.int8), scale
