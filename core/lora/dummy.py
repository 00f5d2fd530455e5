"""Random PEFT adapters for benchmarks (`vserve bench throughput --num-loras N --lora-rank R`): rank-R LoRA on
q/k/v/o and gate/up/down of every layer, shaped from the model's config, saved as PEFT folders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vserve.core.lora.adapter import TARGETS, LoRARequest, _module_shape


def write_dummy_adapters(folder: Path, model_config, num: int, rank: int, seed: int = 0) -> list[LoRARequest]:
    """`num` adapters under folder/lora-{i} (float16 tensors, B non-zero), as LoRARequests with ids 1..num."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(num):
        out = Path(folder) / f"lora-{i}"
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(model_config.num_hidden_layers):
            for target in TARGETS:
                part = "self_attn" if target in TARGETS[:4] else "mlp"
                module = f"model.layers.{layer}.{part}.{target}"
                shape = _module_shape(module, model_config)
                if shape is None:  # MoE layers: attention only
                    continue
                n_out, n_in = shape
                key = f"base_model.model.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) / n_in**0.5).half()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.01).half()
        save_file(tensors, out / "adapter_model.safetensors")
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS), "bias": "none"}))
        requests.append(LoRARequest(f"lora-{i}", i + 1, str(out)))
    return requests
