"""PEFT adapters for the LoRA tests: made with peft on a tiny random HF model, B initialized randomly (PEFT's zero B
would make every adapter the base model), saved as PEFT folders; their HF references merged with peft."""

from __future__ import annotations

from pathlib import Path

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, r: int, alpha: float, targets: list[str], seed: int,
                 rslora: bool = False) -> Path:
    """Save a PEFT LoRA adapter of `base` into `out` (safetensors), with random A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                                  use_rslora=rslora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 / p.shape[-1] ** 0.5 if "lora_A" in name else 0.5))
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


def merged_copy(base: Path, adapter: Path, out: Path) -> Path:
    """The base model with the adapter merged in (peft's merge_and_unload), saved as a plain HF folder."""
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out
