"""Linear layers whose weights load shard by shard (packed q/k/v and gate/up), split over TP ranks."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vserve.core.distributed import all_reduce, get_tp_rank, get_tp_size, shard


class Linear(nn.Module):
    """y = x W^T (+ b). Packed layers list their shards' full output sizes in `out_features`.

    parallel: None (replicated), "column" (each rank holds a slice of every shard's rows) or "row" (each rank
    holds a slice of the input columns; the partial outputs are all-reduced). `parts` names shards split into
    fewer slices than ranks (KV heads fewer than ranks): their slices are replicated over neighbouring ranks.
    """

    def __init__(self, in_features: int, out_features: int | dict, bias: bool = False, parallel: str | None = None,
                 parts: dict | None = None) -> None:
        super().__init__()
        full = out_features if isinstance(out_features, dict) else {None: out_features}
        tp, rank = get_tp_size(), get_tp_rank()
        self.parallel = parallel
        self.shard_parts = {sid: (parts or {}).get(sid, tp) if parallel == "column" else 1 for sid in full}
        self.shard_sizes = {sid: shard_size(size, self.shard_parts[sid], sid) for sid, size in full.items()}
        self.shard_index = {sid: rank * n // tp for sid, n in self.shard_parts.items()}
        self.in_features = shard(in_features, "input features") if parallel == "row" else in_features
        total = sum(self.shard_sizes.values())
        self.weight = nn.Parameter(torch.empty(total, self.in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        offset = 0
        for sid, size in self.shard_sizes.items():
            if sid == shard_id:
                break
            offset += size
        else:
            raise KeyError(f"unknown shard {shard_id!r}")
        size, parts = self.shard_sizes[shard_id], self.shard_parts[shard_id]
        dst = param.data.narrow(0, offset, size)
        expected = (size * parts, *dst.shape[1:])
        if self.parallel == "row" and loaded.dim() == 2:
            expected = (size, self.in_features * get_tp_size())
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}")
        if self.parallel == "column":
            loaded = loaded.narrow(0, self.shard_index[shard_id] * size, size)
        elif self.parallel == "row" and loaded.dim() == 2:
            loaded = loaded.narrow(1, get_tp_rank() * self.in_features, self.in_features)
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel != "row" or get_tp_size() == 1:
            return F.linear(x, self.weight, self.bias)
        y = all_reduce(F.linear(x, self.weight))  # the bias is added once, after the sum of partials
        return y if self.bias is None else y + self.bias


def shard_size(size: int, parts: int, sid) -> int:
    if size % parts:
        raise ValueError(f"--tensor-parallel-size {get_tp_size()} does not divide the model's "
                         f"{sid or 'output'} features ({size})")
    return size // parts
