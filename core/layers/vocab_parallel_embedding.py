"""Vocab-parallel embedding and LM head: each TP rank holds a contiguous slice of the (padded) vocabulary."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vserve.core.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * n, (rank + 1) * n) of the vocabulary padded to a multiple of the TP size."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = get_tp_size()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // tp)
        self.start = get_tp_rank() * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected {(self.num_embeddings, param.shape[1])}")
        rows = loaded[self.start:self.start + self.per_rank]
        param.data[:rows.shape[0]].copy_(rows)  # padding rows stay zero

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        x = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocab-sharded like the embedding; logits are all-gathered to full width."""


def compute_logits(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor:
    logits = all_gather_last_dim(F.linear(hidden, head.weight))
    return logits[..., :head.num_embeddings].float()
