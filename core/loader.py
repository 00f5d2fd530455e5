"""Load a model: pick its device and dtype, build it and load its weights (safetensors,
GGUF or dummy)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from vserve.core.config import EngineConfig
from vserve.core.distributed import get_pp_size
from vserve.core.layers.norm import GemmaRMSNorm
from vserve.core.layers.quantization import QuantConfig
from vserve.core.model_config import ModelConfig, model_source
from vserve.core.models import get_model_class
from vserve.ops.progress import progress_bar

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def count_safetensors(files: list[Path]) -> int:
    from safetensors import safe_open

    n = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            n += len(list(st.keys()))
    return n


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


# experts.{e}.w1/w2/w3 (Mixtral) or experts.{e}.gate_proj/down_proj/up_proj (Qwen-MoE, DeepSeek)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT_PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    quantized = getattr(model, "quant_config", None) is not None
    loaded: set[str] = set()
    layers = getattr(model.config, "num_hidden_layers", None)
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        extra = _LAYER.match(name)  # DeepSeek-V3's multi-token-prediction layer after the last one: not served
        if extra is not None and layers is not None and int(extra.group(1)) >= layers:
            continue
        pname, shard = name, None
        expert = _EXPERT.search(name)  # experts.{e}.w1/w2/w3 -> the stacked experts.w13/w2 weights
        if expert is not None:
            e, w = int(expert.group(1)), _EXPERT_PROJ.get(expert.group(2), expert.group(2))
            stacked = ".experts.w2_weight" if w == "w2" else ".experts.w13_weight"
            pname, shard = name[:expert.start()] + stacked, (e, w)
        for frag, (packed, shard_id) in mapping.items() if expert is None else ():
            if f".{frag}." in name:
                pname, shard = name.replace(f".{frag}.", f".{packed}."), shard_id
                break
        if pname not in params:
            if get_pp_size() > 1 and not _on_this_stage(model, pname):
                continue  # another pipeline stage holds it
            if quantized and _spare_quant_tensor(name, tensor):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        param = params[pname]
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard)
        else:
            default_weight_loader(param, tensor)
        layer = getattr(loader, "__self__", None)
        if shard is None and len(getattr(layer, "shard_sizes", ())) > 1:  # a fused tensor (Phi-3): every shard
            loaded.update(f"{pname}:{s}" for s in layer.shard_sizes)
        else:
            loaded.add(f"{pname}:{shard}")
    missing = []
    for pname, param in params.items():
        layer = getattr(getattr(param, "weight_loader", None), "__self__", None)
        shards = layer.shards_of(param) if hasattr(layer, "shards_of") else list(getattr(layer, "shard_sizes", [None]))
        if not all(f"{pname}:{s}" in loaded for s in shards):
            missing.append(pname)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:3]}")


def _spare_quant_tensor(name: str, tensor: torch.Tensor) -> bool:
    """Tensors quantized checkpoints carry that change nothing: AutoGPTQ's zero biases of bias-free layers (vLLM
    skips them too), compressed-tensors' zero points of symmetric weights and the unpacked shape it records."""
    if name.endswith(".weight_shape"):
        return True
    return name.endswith((".bias", ".weight_zero_point")) and not bool(tensor.any())


def _on_this_stage(model: nn.Module, name: str) -> bool:
    mod = model
    for part in name.split(".")[:-1]:
        if isinstance(mod, nn.ModuleList):
            mod = mod[int(part)] if part.isdigit() and int(part) < len(mod) else None
        else:
            mod = getattr(mod, part, None)
        if mod is None or isinstance(mod, nn.Identity):
            return False
    return True


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights (for benchmarks), drawn on the parameters' own device; quantized layers get random valid
    codes and scales from their quant method."""
    params = list(model.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(params)}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        quantized = [p for p in module.parameters(recurse=False) if getattr(p, "quantized", False)]
        if quantized:
            g = torch.Generator(device=quantized[0].device).manual_seed(seed + index[id(quantized[0])])
            method.init_dummy(module, g)
    centred = {id(m.weight) for m in model.modules() if isinstance(m, GemmaRMSNorm)}  # x (1 + w): w = 0 is 1
    for i, (name, p) in enumerate(params):
        if getattr(p, "quantized", False):
            continue
        if "norm" in name:
            p.data.fill_(0.0 if id(p) in centred or name.endswith(".bias") else 1.0)
        else:
            g = torch.Generator(device=p.device).manual_seed(seed + i)
            p.data.normal_(0.0, 0.02, generator=g)


def resolve_quantization(quantization: str | None, cfg: ModelConfig, fmt: str,
                         device: torch.device | None = None) -> QuantConfig | None:
    """The checkpoint's quantization (config.json's quantization_config), checked against --quantization; and
    whether this device runs it."""
    if fmt == "gguf":
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} does not apply to GGUF files (vserve dequantizes "
                             f"their tensors at load)")
        return None
    qc = QuantConfig.resolve(quantization, cfg.raw, dummy=fmt == "dummy")
    if qc is not None and device is not None and device.type == "cuda" and qc.kind == "fp8":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"FP8 weights need a GPU of compute capability >= 8.9 (Ada, Hopper or newer); "
                             f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}; serve an AWQ, GPTQ "
                             f"or INT8 checkpoint instead")
    return qc


def build_model(cfg: ModelConfig, path: Path, fmt: str, dtype: torch.dtype, device: torch.device,
                seed: int = 0, quantization: str | None = None) -> nn.Module:
    """This rank's model with its weights loaded. quantization: --quantization (None: from config.json); the
    model's `quant_config` holds what was resolved (None: full-precision weights)."""
    quant = resolve_quantization(quantization, cfg, fmt, device)
    try:
        with _default_dtype(dtype), torch.device(device):
            model = get_model_class(cfg)(cfg, quant)
    except torch.OutOfMemoryError:
        from vserve.core.memory import fmt_bytes

        with _default_dtype(dtype), torch.device("meta"):
            params = list(get_model_class(cfg)(cfg, quant).parameters())
        n, size = sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)
        total = torch.cuda.get_device_properties(device).total_memory
        held = f"{n / 1e9:.1f}B parameters, {fmt_bytes(size)} in {dtype}" if quant is None else \
            f"{fmt_bytes(size)}, {quant.describe()}"
        raise ValueError(
            f"the model's weights ({held}) do not "
            f"fit on {device} ({fmt_bytes(total)} in all, some held by other processes); use a quantized "
            f"checkpoint or more GPUs") from None
    if fmt == "dummy":
        init_dummy_weights(model, seed)
    elif fmt == "gguf":
        from vserve.core.gguf_file import gguf_tensor_count, iter_gguf_tensors

        total = gguf_tensor_count(path)
        load_weights(model, progress_bar(iter_gguf_tensors(path), total, "Loading GGUF weights"))
    else:
        files = safetensors_files(path)
        total = count_safetensors(files)
        load_weights(model, progress_bar(iter_safetensors(files), total, "Loading weights"))
    for module in model.modules():  # repacking for the kernels, once (kernels/w4a16_configs.json decides W4A16's)
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA GPU")
    return torch.device(name)


def pick_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    # vLLM's rule: bf16 checkpoints stay bf16, fp16/fp32 ones run in fp16.
    return torch.bfloat16 if cfg.torch_dtype == "bfloat16" else torch.float16


def needs_activation_profile(config: EngineConfig, device: torch.device) -> bool:
    # Under PP a lone forward cannot run (its stages wait on each other): the planner estimates instead.
    return (device.type == "cuda" and config.num_kv_blocks is None and not config.kv_cache_memory_gib
            and config.pipeline_parallel_size == 1)


def load_model(config: EngineConfig, device: torch.device):
    """(model config, path, format, dtype, model): this rank's shard of the weights."""
    path, fmt, mc = model_source(config)
    dtype = pick_dtype(config.dtype, mc, device)
    return mc, path, fmt, dtype, build_model(mc, path, fmt, dtype, device, config.seed, config.quantization)
