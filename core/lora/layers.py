"""LoRA on the model's linear layers: every adapted projection holds its adapters stacked by slot (A [slots, L*R,
in], B [slots, out, R], L the packed slices), and a forward hook adds each row's slot's x·Aᵀ·Bᵀ to the base output
through kernels' lora_shrink / lora_expand. The rows' slots come once per step (`LoRAModel.set_batch`).

Under TP the A and B matrices shard as their base layer: a column-parallel layer (qkv, gate_up) keeps all of A and
this rank's rows of B; a row-parallel one (o, down) this rank's input columns of A (the rank-R partial products are
all-reduced before the expand) and all of B."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from vserve.core.distributed import all_reduce, get_tp_size
from vserve.core.layers.linear import Linear
from vserve.core.lora.adapter import load_adapter
from vserve.kernels import for_device
from vserve.kernels.lora_ref import LoRAMapping, lora_mapping

# vserve's packed projections and the checkpoint (PEFT) modules of their slices, in the slices' order
SLICES = {"qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"}, "gate_up_proj": {0: "gate_proj", 1: "up_proj"},
          "o_proj": {None: "o_proj"}, "down_proj": {None: "down_proj"}}


def stored_rank(max_lora_rank: int) -> int:
    """The rank the stacks hold: --max-lora-rank, at least 16 (the kernels' smallest dot)."""
    return max(16, max_lora_rank)


class LoRALayer:
    """One projection's adapter slots and the hook that applies them."""

    def __init__(self, linear: Linear, name: str, state: LoRAModel) -> None:
        leaf = name.rsplit(".", 1)[-1]
        slices = SLICES[leaf]
        if list(linear.shard_sizes) != list(slices):
            raise ValueError(f"{name}: unexpected packing {list(linear.shard_sizes)}")
        self.linear, self.state = linear, state
        self.modules = [name[: -len(leaf)] + m for m in slices.values()]  # PEFT module names, one per slice
        R, S = state.rank, state.num_slots
        self.lora_a = torch.zeros(S, len(slices) * R, linear.in_features, dtype=state.dtype, device=state.device)
        self.lora_b = torch.zeros(S, linear.out_features, R, dtype=state.dtype, device=state.device)
        sizes = list(linear.shard_sizes.values())
        self.bounds = tuple(sum(sizes[:j]) for j in range(len(sizes) + 1))
        self.row_parallel = linear.parallel == "row" and get_tp_size() > 1
        linear.register_forward_hook(self.forward_hook)

    def set_slot(self, slot: int, adapter: dict | None) -> None:
        """Copy an adapter's matrices of this layer (this rank's shards) into a slot (None: clear it)."""
        lin, R = self.linear, self.state.rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if adapter is None:
            return
        for j, (sid, module) in enumerate(zip(lin.shard_sizes, self.modules)):
            if module not in adapter:
                continue
            a, b = adapter[module]
            r = a.shape[0]
            if lin.input_splits > 1:  # row-parallel: this rank's input columns
                a = a[:, lin.input_rank * lin.in_features:(lin.input_rank + 1) * lin.in_features]
            if lin.parallel == "column":  # this rank's output rows of the slice
                size = lin.shard_sizes[sid]
                b = b[lin.shard_index[sid] * size:(lin.shard_index[sid] + 1) * size]
            lo, hi = self.bounds[j], self.bounds[j + 1]
            if a.shape[1] != lin.in_features or b.shape[0] != hi - lo:
                raise ValueError(f"LoRA {module}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the layer")
            self.lora_a[slot, j * R:j * R + r] = a.to(self.lora_a.dtype)
            self.lora_b[slot, lo:hi, :r] = b.to(self.lora_b.dtype)

    def forward_hook(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        m = self.state.mapping
        if m is None:
            return out
        x = args[0]
        ops = for_device(out)
        # split-K partial sums are added up by the expand, except where they are all-reduced first
        buf = ops.lora_shrink(x.reshape(-1, x.shape[-1]), self.lora_a, m, partial=not self.row_parallel)
        if self.row_parallel:
            buf = all_reduce(buf)  # partial x·Aᵀ over this rank's input columns
        ops.lora_expand(buf, self.lora_b, out, m, self.bounds)
        return out


class LoRAModel:
    """A model's LoRA layers and adapter slots in this process (every TP rank has one): loads adapters into slots as
    the step says (`apply_loads`), keeping CPU copies of up to max_cpu_loras adapters (least recently used out)."""

    def __init__(self, model: nn.Module, num_slots: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots, self.rank, self.dtype, self.device = num_slots, stored_rank(max_lora_rank), dtype, device
        self.max_cpu_loras = max_cpu_loras
        self.mapping: LoRAMapping | None = None  # this step's rows by slot; None: no row has an adapter
        self.cpu: OrderedDict[int, dict] = OrderedDict()
        self.layers: list[LoRALayer] = []
        for name, mod in model.named_modules():
            if isinstance(mod, Linear) and name.rsplit(".", 1)[-1] in SLICES:
                if mod.input_quant_dtype is not None:
                    raise ValueError("--enable-lora with W8A8 quantized linears (fp8/int8 activations) is not "
                                     "supported; serve a weight-only quantized or unquantized model")
                self.layers.append(LoRALayer(mod, name, self))
        self.modules = {m for layer in self.layers for m in layer.modules}  # the PEFT modules these layers adapt
        if not self.layers:
            raise ValueError("--enable-lora: this model has no projections vserve adapts (q/k/v/o, gate/up/down)")

    def nbytes(self) -> int:
        return sum(la.lora_a.nbytes + la.lora_b.nbytes for la in self.layers)

    def set_batch(self, slots: torch.Tensor | None) -> None:
        """This step's slot per token (on the device), or None when no row has an adapter."""
        self.mapping = None if slots is None else lora_mapping(slots, self.num_slots)

    def adapter(self, lora_id: int, path: str) -> dict:
        """The adapter's CPU copy (loaded from its folder when not cached)."""
        if lora_id in self.cpu:
            self.cpu.move_to_end(lora_id)
            return self.cpu[lora_id]
        # scaled in float32, kept in the model's dtype (a bf16 8B model's rank-16 adapter: 84 MB, not 168)
        weights = {m: (a.to(self.dtype), b.to(self.dtype)) for m, (a, b) in load_adapter(path).items()}
        self.cpu[lora_id] = weights
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return weights

    def apply_loads(self, loads: list[tuple[int, int, str]]) -> None:
        for slot, lora_id, path in loads:
            weights = self.adapter(lora_id, path)
            # the front end checked the modules against the model's config; this is the model's own word
            assert set(weights) <= self.modules, f"adapter {path} adapts {sorted(set(weights) - self.modules)[:3]}"

            for layer in self.layers:
                layer.set_slot(slot, weights)

    def forget(self, lora_id: int) -> None:
        self.cpu.pop(lora_id, None)
