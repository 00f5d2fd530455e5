"""Linear layers whose weights load shard by shard (packed q/k/v and gate/up)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Linear(nn.Module):
    """y = x W^T (+ b). Packed layers list their shards' output sizes in `shard_sizes`."""

    def __init__(self, in_features: int, out_features: int | dict[str, int], bias: bool = False) -> None:
        super().__init__()
        self.shard_sizes = out_features if isinstance(out_features, dict) else {None: out_features}
        total = sum(self.shard_sizes.values())
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
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
        size = self.shard_sizes[shard_id]
        dst = param.data.narrow(0, offset, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
