"""Multi-LoRA serving: PEFT adapters (adapter.py), the layers' stacked adapter slots (layers.py), the engine's slot
LRU (manager.py) and the front ends' adapter names (registry.py); docs/lora.md."""

from __future__ import annotations


def attach_lora(model, config, dtype, device):
    """The model's LoRAModel when config.enable_lora (its projections then carry adapter slots), else None."""
    if not config.enable_lora:
        return None
    from vserve.core.lora.layers import LoRAModel

    return LoRAModel(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras,
                     dtype, device)
