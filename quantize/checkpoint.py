"""The folder `vserve quantize` writes: config.json with the `quantization_config` the reference tool writes
(AutoAWQ, GPTQModel, llm-compressor), one model.safetensors, and the source's tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import vserve

# Everything a tokenizer, chat template or generation default can live in; copied when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")


def awq_config(group_size: int) -> dict:
    """What AutoAWQ 0.2.9 writes (`AwqConfig.to_transformers_dict`) for the GEMM kernel."""
    return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4, "version": "gemm",
            "modules_to_not_convert": None}


def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool, damp_percent: float = 0.01) -> dict:
    """GPTQModel's keys (AutoGPTQ's are a subset), checkpoint_format "gptq": qzeros stored minus one."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "lm_head": False, "damp_percent": damp_percent, "true_sequential": True, "static_groups": False,
            "checkpoint_format": "gptq", "pack_dtype": "int32", "meta": {"quantizer": [f"vserve:{vserve.__version__}"]}}


def _ct_args(num_bits: int, kind: str, strategy: str, dynamic: bool) -> dict:
    return {"num_bits": num_bits, "type": kind, "symmetric": True, "group_size": None, "strategy": strategy,
            "dynamic": dynamic}


def compressed_tensors_config(kind: str, weight_only: bool) -> dict:
    """llm-compressor's FP8_DYNAMIC / W8A8 (or their weight-only forms) as compressed-tensors 0.20 serializes them:
    channel-wise symmetric 8-bit weights, dynamic per-token symmetric 8-bit input activations."""
    ctype = "float" if kind == "fp8" else "int"
    fmt = "float-quantized" if kind == "fp8" else ("pack-quantized" if weight_only else "int-quantized")
    group = {"targets": ["Linear"], "weights": _ct_args(8, ctype, "channel", False),
             "input_activations": None if weight_only else _ct_args(8, ctype, "token", True),
             "output_activations": None, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed",
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}


def write_folder(out_dir: Path, source: Path, quantization_config: dict, dtype_name: str, tensors: dict,
                 overwrite: bool) -> None:
    """Write into a temporary sibling, then rename: an interrupted run never leaves a half-written model."""
    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    config["torch_dtype"] = dtype_name
    if "dtype" in config:
        config["dtype"] = dtype_name
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, tmp / name)
    if out_dir.exists():
        if not overwrite and any(out_dir.iterdir()):  # re-checked: it may have appeared while we worked
            shutil.rmtree(tmp)
            raise ValueError(f"--output-dir {str(out_dir)!r} is not empty (pass --overwrite to replace it)")
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def quantization_config_of(folder: Path) -> dict | None:
    return json.loads((Path(folder) / "config.json").read_text()).get("quantization_config")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
