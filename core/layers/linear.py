"""Linear layers whose weights load shard by shard (packed q/k/v and gate/up), split over TP ranks."""

from __future__ import annotations

import torch
from torch import nn

from vserve.core.distributed import all_reduce, get_tp_rank, get_tp_size, shard
from vserve.core.layers.quantization import QuantConfig, QuantizedActivation, UnquantizedMethod


class Linear(nn.Module):
    """y = x W^T (+ b). Packed layers list their shards' full output sizes in `out_features`.

    parallel: None (replicated), "column" (each rank holds a slice of every shard's rows) or "row" (each rank
    holds a slice of the input columns; the partial outputs are all-reduced). `parts` names shards split into
    fewer slices than ranks (KV heads fewer than ranks): their slices are replicated over neighbouring ranks.
    quant_config and prefix (the layer's name in the model) pick the weights' quant method; its parameters say
    which of their dims hold output and input features and how densely (see layers/quantization.py).
    """

    def __init__(self, in_features: int, out_features: int | dict, bias: bool = False, parallel: str | None = None,
                 parts: dict | None = None, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        full = out_features if isinstance(out_features, dict) else {None: out_features}
        tp, rank = get_tp_size(), get_tp_rank()
        self.parallel = parallel
        self.shard_parts = {sid: (parts or {}).get(sid, tp) if parallel == "column" else 1 for sid in full}
        self.shard_sizes = {sid: shard_size(size, self.shard_parts[sid], sid) for sid, size in full.items()}
        self.shard_index = {sid: rank * n // tp for sid, n in self.shard_parts.items()}
        self.in_features = shard(in_features, "input features") if parallel == "row" else in_features
        self.input_splits, self.input_rank = (tp, rank) if parallel == "row" else (1, 0)
        self.out_features = sum(self.shard_sizes.values())  # this rank's
        method = quant_config.linear_method(prefix) if quant_config is not None else None
        self.quant_method = method or UnquantizedMethod()
        self.quant_method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        if self.bias is not None:
            self.bias.output_dim, self.bias.input_dim, self.bias.out_pack = 0, None, 1
            self.bias.scalar_ok = self.bias.quantized = False
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None and len(self.shard_sizes) > 1:
            return self._load_fused(param, loaded)
        offset = 0
        for sid, size in self.shard_sizes.items():
            if sid == shard_id:
                break
            offset += size
        else:
            raise KeyError(f"unknown shard {shard_id!r}")
        size, parts = self.shard_sizes[shard_id], self.shard_parts[shard_id]
        dst, od, idim = param.data, param.output_dim, param.input_dim
        split_in = self.input_splits > 1 and idim is not None and param.split_input
        if od is not None:
            pack = param.out_pack
            dst = dst.narrow(od, offset // pack, size // pack)
        expected = list(dst.shape)
        if od is not None:
            expected[od] = size * parts // pack
        if split_in:
            expected[idim] *= self.input_splits
        if param.scalar_ok and loaded.numel() == 1:  # a per-tensor scale: every output channel of the shard
            loaded = loaded.reshape(1).to(param.dtype).expand(expected[od]).reshape(expected)
        if list(loaded.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}")
        if self.parallel == "column" and od is not None:
            loaded = loaded.narrow(od, self.shard_index[shard_id] * size // pack, size // pack)
        if split_in:
            n = dst.shape[idim]
            loaded = loaded.narrow(idim, self.input_rank * n, n)
        if od is None and len(self.shard_sizes) > 1:  # one tensor for all shards (GPTQ's g_idx): they must agree
            if getattr(param, "shared_loaded", False) and not torch.equal(dst, loaded.to(dst.dtype)):
                raise ValueError(f"shard {shard_id!r} of a packed layer has a different {tuple(loaded.shape)} "
                                 f"tensor than the shards before it; vserve packs them and needs them equal")
            param.shared_loaded = True
        dst.copy_(loaded)

    def _load_fused(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A checkpoint tensor holding every shard, in order along the output dim (Phi-3's qkv_proj and
        gate_up_proj): each shard's part goes through the per-shard path (TP slices included)."""
        od = param.output_dim
        if od is None or (param.scalar_ok and loaded.numel() == 1):  # one tensor for all shards: each gets it
            for sid in self.shard_sizes:
                self.weight_loader(param, loaded, sid)
            return
        full = {sid: size * self.shard_parts[sid] // param.out_pack for sid, size in self.shard_sizes.items()}
        if loaded.shape[od] != sum(full.values()):
            raise ValueError(f"checkpoint tensor has {loaded.shape[od]} output rows in dim {od}, expected "
                             f"{sum(full.values())} (the fused {', '.join(map(str, full))} shards)")
        for sid, part in zip(full, loaded.split(list(full.values()), dim=od)):
            self.weight_loader(param, part, sid)

    @property
    def input_quant_dtype(self) -> torch.dtype | None:
        """What a W8A8 layer quantizes its input to per token (float8_e4m3fn or int8): the kernel producing the
        input may pass it quantized already, as a QuantizedActivation. None: forward takes a tensor only."""
        return self.quant_method.input_quant_dtype

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if self.parallel != "row" or get_tp_size() == 1:
            return self.quant_method.apply(self, x, self.bias)
        y = all_reduce(self.quant_method.apply(self, x, None))  # the bias is added once, after the sum of partials
        return y if self.bias is None else y + self.bias


def shard_size(size: int, parts: int, sid) -> int:
    if size % parts:
        raise ValueError(f"--tensor-parallel-size {get_tp_size()} does not divide the model's "
                         f"{sid or 'output'} features ({size})")
    return size // parts
