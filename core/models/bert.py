"""BERT encoders (BertModel / BertForMaskedLM checkpoints): post-LN, bidirectional attention over padded batches."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from vserve.core.layers.linear import Linear

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}

# HF checkpoint name fragments -> ours, applied in order ("attention.output." before "output.")
_RENAMES = (
    ("encoder.layer.", "layers."),
    ("embeddings.LayerNorm.", "embeddings.norm."),
    ("attention.self.", ""),
    ("attention.output.dense.", "attn_out."),
    ("attention.output.LayerNorm.", "attn_norm."),
    ("intermediate.dense.", "intermediate."),
    ("output.dense.", "output."),
    ("output.LayerNorm.", "output_norm."),
)
# heads and buffers a BertModel / BertForMaskedLM checkpoint may carry that an encoder does not use
_UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


@dataclass(slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int

    @classmethod
    def from_dict(cls, cfg: dict) -> BertConfig:
        pos = cfg.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ValueError(f"BERT position_embedding_type {pos!r} is not supported (only 'absolute')")
        act = cfg.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"BERT hidden_act {act!r} is not supported; vserve knows {', '.join(ACTIVATIONS)}")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            max_position_embeddings=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            hidden_act=act,
            pad_token_id=cfg.get("pad_token_id") or 0,
        )


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # single-segment inputs: every token has token type 0
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.norm(x)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.h, self.d = cfg.num_attention_heads, hidden // cfg.num_attention_heads
        self.qkv = Linear(hidden, {"q": hidden, "k": hidden, "v": hidden}, bias=True)
        self.attn_out = Linear(hidden, hidden, bias=True)
        self.attn_norm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.intermediate = Linear(hidden, cfg.intermediate_size, bias=True)
        self.output = Linear(cfg.intermediate_size, hidden, bias=True)
        self.output_norm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden]; mask [B, 1, 1, T], True where the key is a real token."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attn_norm(x + self.attn_out(o.transpose(1, 2).reshape(B, T, self.h * self.d)))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


class BertModel(nn.Module):
    """The encoder: token ids [B, T] + attention mask [B, T] -> last hidden states [B, T, hidden]."""

    # checkpoint name fragment (after checkpoint_name) -> (parameter name fragment, shard id)
    packed_modules_mapping = {"query": ("qkv", "q"), "key": ("qkv", "k"), "value": ("qkv", "v")}

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask[:, None, None, :].bool()
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return x

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our name for an HF BERT tensor (`bert.`-prefixed or not); None for tensors the encoder does not use."""
        name = name.removeprefix("bert.")
        if name.startswith(_UNUSED_PREFIXES):
            return None
        for old, new in _RENAMES:
            name = name.replace(old, new)
        # checkpoints from the TensorFlow era name LayerNorm parameters gamma/beta
        if name.endswith(".gamma"):
            name = name.removesuffix(".gamma") + ".weight"
        elif name.endswith(".beta"):
            name = name.removesuffix(".beta") + ".bias"
        return name
