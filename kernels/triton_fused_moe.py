"""Grouped fused MoE, as vLLM's and SGLang's Triton fused_moe: the (token, slot) rows are sorted by expert and each
expert's run padded to BLOCK_M (`moe_align_block_size`), so every block of BLOCK_M rows belongs to one expert and
one tensor-core GEMM (`tl.dot`) per projection covers all experts in one launch:

    gate_up: act[r] = silu(x[t] . w13[e, :I]) * (x[t] . w13[e, I:])      (r = t*k + s; both halves in one program)
    down:    y[r]   = topk_weights[r] * (act[r] . w2[e])                  (the routing weight in the epilogue)
    out[t]  = sum over s of y[t*k + s]

Launch configs come from kernels/fused_moe_configs.json by (E, I, H) and a batch bucket, with a default table; for
at most its `per_row_max_tokens` tokens the per-row GEMV kernel of kernels/triton_moe.py runs instead (tiny decode
batches). Matches kernels/moe_ref.py:fused_moe_ref (same signature); accumulation in fp32.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch
import triton
import triton.language as tl

from vserve.kernels.triton_moe import fused_moe_per_row

CONFIG_FILE = Path(__file__).with_name("fused_moe_configs.json")


@cache
def moe_configs(path: str | None = None) -> dict:
    """The launch-config table (kernels/fused_moe_configs.json unless a path is given)."""
    return json.loads(Path(path or CONFIG_FILE).read_text())


def get_config(num_experts: int, inter: int, hidden: int, num_tokens: int, table: dict | None = None) -> dict:
    """The launch config for num_tokens tokens through E experts of [I, H] (one rank's I): the shape's own table
    where there is one, else the default; within it the entry of the largest batch bucket <= num_tokens."""
    table = table or moe_configs()
    buckets = table["shapes"].get(f"E={num_experts},I={inter},H={hidden}") or table["default"]
    keys = sorted(int(k) for k in buckets)
    return dict(buckets[str(max([k for k in keys if k <= num_tokens], default=keys[0]))])


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As moe_align_block_size_ref, in tensor ops without a host sync (sizes depend on T, k, E only, so a CUDA
    graph can hold it): a stable sort by expert, each row's place = its expert's padded start + its rank."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    num_blocks = triton.cdiv(n + num_experts * (block_size - 1), block_size)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((num_blocks * block_size,), n, dtype=torch.int32, device=dev)
    sorted_ids[ends[expert] - padded[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=dev) * block_size
    expert_ids = torch.searchsorted(ends, starts, right=True)  # the first expert whose run ends past the start
    expert_ids = torch.where(starts < ends[-1], expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, tw_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                     N, K, EM, num_rows, a_div, stride_am, stride_be, stride_bn, stride_cm,
                     GATE_UP: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of c[r] = a[r // a_div] . b[e]^T over one expert's block of sorted rows r.
    GATE_UP: b holds [gate | up] (N rows each) and the tile is silu(gate) * up. MUL_WEIGHT: times tw[r]."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(EM, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n  # GROUP_M row blocks share their B tiles through L2
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows  # padding rows hold num_rows
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // a_div).to(tl.int64)[:, None] * stride_am + k[None, :]
    b_ptrs = b_ptr + e * stride_be + n[None, :].to(tl.int64) * stride_bn + k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_in[:, None] & (n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATE_UP:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_in[:, None] & (n[None, :] < N), other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = c_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)  # rounded where the reference's F.linear rounds
    if GATE_UP:
        out = (out / (1.0 + tl.exp(-out))).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    if MUL_WEIGHT:
        out = out * tl.load(tw_ptr + rows, mask=valid, other=0.0).to(dtype).to(tl.float32)[:, None]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + n[None, :], out.to(dtype),
             mask=valid[:, None] & (n[None, :] < N))


def _launch(a, b, c, tw, sorted_ids, expert_ids, num_post, N, K, a_div, gate_up, cfg) -> None:
    EM = sorted_ids.numel()
    grid = (triton.cdiv(EM, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](a, b, c, tw, sorted_ids, expert_ids, num_post, N, K, EM, c.shape[0], a_div,
                           a.stride(0), b.stride(0), b.stride(1), c.stride(0), GATE_UP=gate_up, MUL_WEIGHT=not gate_up,
                           PRECISION="ieee" if a.dtype == torch.float32 else "tf32", BLOCK_M=cfg["BLOCK_M"],
                           BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                           num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, config: dict | None = None,
              per_row_max_tokens: int | None = None) -> torch.Tensor:
    """As fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, k] -> [T, H].
    config: a launch config (BLOCK_M/N/K, GROUP_M, num_warps, num_stages) in place of the table's;
    per_row_max_tokens: in place of the table's (0: always grouped)."""
    T, H = x.shape
    E, k, I = w13.shape[0], topk_ids.shape[1], w2.shape[2]
    limit = moe_configs()["per_row_max_tokens"] if per_row_max_tokens is None else per_row_max_tokens
    if T <= limit:
        return fused_moe_per_row(x, w13, w2, topk_weights, topk_ids)
    cfg = config or get_config(E, I, H, T)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg["BLOCK_M"], E)
    act = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    _launch(x, w13, act, tw, sorted_ids, expert_ids, num_post, I, H, k, True, cfg)
    out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    _launch(act, w2, out, tw, sorted_ids, expert_ids, num_post, H, I, 1, False, cfg)
    return out.view(T, k, H).sum(dim=1)
