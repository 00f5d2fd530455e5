"""Rotary position embedding: rotate-half (HF's Llama layout) or interleaved pairs (GPT-J style, Command R), over
the whole head or its first rotary_dim dims, with linear, llama3, yarn (DeepSeek) and longrope (Phi-3) frequency
scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from vserve.kernels import for_device


def _inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn, longrope)")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 mscale ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(scaling: dict, max_position: int | None = None) -> float:
    return scaling.get("factor") or max_position / scaling["original_max_position_embeddings"]


def _yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): interpolated frequencies below the beta_slow rotations,
    extrapolated above beta_fast, a linear ramp between."""
    factor, original = _yarn_factor(scaling), scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high)
                                                                              - low), 0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def yarn_attention_factor(scaling: dict, max_position: int) -> float:
    """What YaRN scales cos and sin by: attention_factor, else mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) where both are set (DeepSeek), else mscale(factor)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_position)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
    return yarn_get_mscale(factor)


def _longrope(dim: int, theta: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-position frequencies (short factors below original_max_position_embeddings, long
    factors from there) [max_position, dim/2], and the attention factor cos and sin are scaled by."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta ** exponent)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta ** exponent)
    t = torch.arange(max_position, dtype=torch.float32)[:, None]
    # HF picks the factors per forward: long once the sequence is longer than the original length (its cached keys
    # keep the ones they were computed with). So a token at position p takes the long factors when p >= original or
    # when its prompt is longer than original (the prompt's one forward in HF). Rows [0, max_position): short below
    # original, long from there; rows max_position + p (p < original): long, for the tokens of such prompts
    # (ModelRunner offsets their positions: longrope_offset).
    first = torch.arange(min(original, max_position), dtype=torch.float32)[:, None]
    return torch.cat((torch.where(t < original, t * short, t * long), first * long)), float(attn)


def longrope_offset(scaling: dict | None, max_position: int) -> tuple[int, int] | None:
    """(original length, row offset) of a LongRoPE table (see _longrope), None for other RoPE types: a token at
    position p < original whose prompt is longer than original reads row p + offset."""
    if (scaling or {}).get("rope_type") != "longrope":
        return None
    return scaling["original_max_position_embeddings"], max_position


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None,
                 rotary_dim: int | None = None, interleaved: bool = False) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self._head_dim = head_dim
        self.interleaved = interleaved
        if (scaling or {}).get("rope_type") == "yarn" and not scaling.get("factor"):  # DeepSeek-V3: from the lengths
            scaling = {**scaling, "factor": _yarn_factor(scaling, max_position)}
        if (scaling or {}).get("rope_type") == "longrope":
            freqs, attn = _longrope(self.rotary_dim, theta, scaling, max_position)
        else:
            t = torch.arange(max_position, dtype=torch.float32)
            freqs, attn = torch.outer(t, _inv_freq(self.rotary_dim, theta, scaling)), 1.0
            if (scaling or {}).get("rope_type") == "yarn":
                attn = yarn_attention_factor(scaling, max_position)
        # float32 tables [max_position, rotary_dim / 2]; gathered per step by position.
        self.register_buffer("cos", freqs.cos() * attn, persistent=False)
        self.register_buffer("sin", freqs.sin() * attn, persistent=False)

    @property
    def rotates_whole_heads(self) -> bool:
        """Rotate-half over the whole head: the attention layer may fuse it into its KV store (rope_store_kvcache)."""
        return not self.interleaved and self.rotary_dim == self._head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, d], k [T, kvh, d] -> rotated copies (kernels: rotary_embedding for rotate-half)."""
        r = self.rotary_dim
        if self.interleaved:
            return self._interleaved(positions, q), self._interleaved(positions, k)
        if r == q.shape[-1]:
            return for_device(q).rotary_embedding(positions, q, k, self.cos, self.sin)
        q_rot, k_rot = for_device(q).rotary_embedding(positions, q[..., :r], k[..., :r], self.cos, self.sin)
        return torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)

    def _interleaved(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """GPT-J layout: dims (2i, 2i + 1) rotate together by frequency i; in fp32, rounded once."""
        c, s = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        r = self.rotary_dim
        xf = x[..., :r].float()
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2).to(x.dtype)
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), -1)
