"""Sparse MoE: a replicated router over experts whose intermediate dim is split over TP ranks (each rank holds a
slice of every expert; the partial outputs are all-reduced). Mixtral's and Qwen-MoE's softmax top-k here; DeepSeek's
grouped routing in core/models/deepseek_v2.py."""

from __future__ import annotations

import torch
from torch import nn

from vserve.core.distributed import all_reduce, get_tp_rank, get_tp_size, shard
from vserve.core.layers.linear import Linear
from vserve.kernels import for_device


class FusedMoE(nn.Module):
    """All experts' weights stacked: w13_weight [E, 2 I/tp, H] = [gate | up], w2_weight [E, H, I/tp]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.inter = shard(intermediate_size, "expert intermediate size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.num_experts = num_experts

    def shards_of(self, param: nn.Parameter) -> list[tuple[int, str]]:
        """The checkpoint shards a parameter needs: (expert, "w1" gate | "w3" up) or (expert, "w2" down)."""
        names = ("w2",) if param is self.w2_weight else ("w1", "w3")
        return [(e, w) for e in range(self.num_experts) for w in names]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        e, w = shard_id
        n, r = self.inter, get_tp_rank()
        if w == "w2":
            dst, src = param.data[e], loaded.narrow(1, r * n, n) if loaded.shape[1] == n * get_tp_size() else None
        else:
            dst = param.data[e].narrow(0, 0 if w == "w1" else n, n)
            src = loaded.narrow(0, r * n, n) if loaded.shape[0] == n * get_tp_size() else None
        if src is None or src.shape != dst.shape:
            raise ValueError(f"checkpoint tensor for expert {e} {w} has shape {tuple(loaded.shape)}, which does "
                             f"not fit {tuple(dst.shape)} x {get_tp_size()} ranks")
        dst.copy_(src)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (all-reduce it under TP)."""
        return for_device(x).fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [T, top_k]: the top-k of the softmax in fp32, renormalized over the chosen experts or
    not (Qwen-MoE's norm_topk_prob), as HF's routers."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_top_k(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", num_group: int = 1,
                  topk_group: int = 1, group_score: str = "max", correction_bias: torch.Tensor | None = None,
                  renormalize: bool = False, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeekMoE routing as HF's routers (fp32): scores = softmax (V2) or sigmoid (V3) of the logits; the experts
    in num_group groups, only the topk_group best groups eligible (a group's score: its best expert's, "max", V2's
    group_limited_greedy, or its two best summed with the correction bias, "top2", V3); the top-k eligible experts by
    score (+ correction_bias: V3's e_score_correction_bias, which picks but does not weigh), their scores as weights,
    renormalized or not, times routed_scaling_factor."""
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, num_group, E // num_group)
        group_scores = grouped.max(-1).values if group_score == "max" else grouped.topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1.0).bool()
        # V2 zeroes the other groups' scores, V3 sets them to -inf (the same choice unless scores tie at 0)
        choice = choice.masked_fill(~keep[:, :, None].expand(-1, -1, E // num_group).reshape(T, E),
                                    0.0 if group_score == "max" else float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class SparseMoeBlock(nn.Module):
    """Mixtral's block_sparse_moe (Qwen-MoE's mlp): gate (router) and experts; renormalize: the top-k weights sum
    to 1 (Mixtral; Qwen-MoE's norm_topk_prob)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_top_k(self.gate(x), self.top_k, self.renormalize)
        return all_reduce(self.experts(x, weights, ids))
