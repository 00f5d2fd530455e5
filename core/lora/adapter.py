"""PEFT LoRA adapters: `LoRARequest` (vLLM's), reading and checking an adapter folder, its weights per module.

A folder holds adapter_config.json and adapter_model.safetensors (pickled adapter_model.bin is refused: loading it
runs code). Targets may be any of q/k/v/o_proj and gate/up/down_proj; vserve packs q/k/v and gate/up into one
projection each, and a packed layer's LoRA holds one A and one B per slice. B is stored multiplied by the scaling
(lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vserve.core.config import LORA_RANKS  # noqa: F401  (re-exported: --max-lora-rank's choices)

if TYPE_CHECKING:
    import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request (vLLM's): a name, a positive int id unique per adapter, and its local folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")


@dataclass(frozen=True)
class AdapterInfo:
    """What the front end checked of an adapter folder: its rank and the modules it adapts."""

    path: str
    rank: int
    modules: tuple[str, ...]  # e.g. model.layers.0.self_attn.q_proj


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def resolve_adapter_path(path: str, download_dir: str | None = None, token: str | None = None) -> str:
    """A local folder for an adapter: a path as it is, or a hub id (org/name) through huggingface_hub's cache,
    fetching adapter_config.json and adapter_model.safetensors only (never pickle); HF_HUB_OFFLINE=1: the cache
    alone. A path that is neither is left to inspect_adapter's 'is not a folder'."""
    from vserve.core import hub

    ref = None if Path(path).expanduser().exists() else hub.HubModel.parse(path)
    if ref is None or ref.quant:
        return path
    from huggingface_hub import HfApi, snapshot_download

    repo_id, cache = ref.repo_id, str(hub.cache_dir(download_dir))
    try:
        if hub._offline():
            return snapshot_download(repo_id, allow_patterns=list(ADAPTER_FILES), cache_dir=cache,
                                     local_files_only=True)
        info = HfApi(token=token).model_info(repo_id)
        names = {s.rfilename for s in info.siblings or []}
        if "adapter_config.json" not in names:
            raise ValueError(f"hub repo {repo_id!r} has no adapter_config.json: it is not a PEFT adapter")
        if "adapter_model.safetensors" not in names:
            raise ValueError(f"hub repo {repo_id!r} holds no adapter_model.safetensors (pickled weights can run code "
                             f"when loaded; vserve reads safetensors only)")
        return snapshot_download(repo_id, revision=info.sha, allow_patterns=list(ADAPTER_FILES), cache_dir=cache,
                                 token=token, tqdm_class=hub._hf_tqdm())
    except ValueError:
        raise
    except Exception as e:  # HfHubHTTPError, LocalEntryNotFoundError, connection errors
        raise hub._hub_error(e, repo_id, "main") from None


def _config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {str(folder)!r} is not a folder")
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.exists():
        raise ValueError(f"LoRA adapter {str(folder)!r} has no adapter_config.json (a PEFT adapter folder has one)")
    if not (folder / "adapter_model.safetensors").exists():
        if any((folder / n).exists() for n in ("adapter_model.bin", "adapter_model.pt")):
            raise ValueError(f"LoRA adapter {str(folder)!r} holds pickled weights (adapter_model.bin), which can run "
                             f"code when loaded; vserve reads adapter_model.safetensors only (save it with "
                             f"save_pretrained(..., safe_serialization=True))")
        raise ValueError(f"LoRA adapter {str(folder)!r} has no adapter_model.safetensors")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {str(folder)!r}: adapter_config.json is not valid JSON ({e})") from None


def _refusals(cfg: dict) -> str | None:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        return f"peft_type {cfg.get('peft_type')!r} (only LORA adapters are served)"
    if cfg.get("use_dora"):
        return "DoRA (use_dora) adapters"
    if cfg.get("bias", "none") != "none":
        return f"LoRA biases (bias={cfg.get('bias')!r})"
    if cfg.get("modules_to_save"):
        return f"modules_to_save ({cfg.get('modules_to_save')})"
    if cfg.get("fan_in_fan_out"):
        return "fan_in_fan_out (transposed, GPT-2 Conv1D) weights"
    if cfg.get("alpha_pattern"):
        return "alpha_pattern (per-module lora_alpha)"
    return None


def inspect_adapter(path: str, max_lora_rank: int, model_config=None) -> AdapterInfo:
    """Check an adapter folder without loading its weights (ValueError naming what is wrong): config, targets,
    rank <= max_lora_rank, tensor shapes against the model's (model_config: a ModelConfig, when given)."""
    from safetensors import safe_open

    folder = Path(path).expanduser()
    cfg = _config(folder)
    why = _refusals(cfg)
    if why is not None:
        raise ValueError(f"LoRA adapter {path!r}: {why} are not supported")
    shapes: dict[str, dict[str, tuple]] = {}
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        for key in f.keys():
            if "lora_embedding" in key or ".embed_tokens." in key or ".lm_head." in key:
                raise ValueError(f"LoRA adapter {path!r} adapts the embeddings or the LM head ({key}); vserve serves "
                                 f"adapters of the attention and MLP projections only ({', '.join(TARGETS)})")
            found = _KEY.match(key)
            if found is None:
                raise ValueError(f"LoRA adapter {path!r}: unexpected tensor {key!r} (expected *.lora_A.weight and "
                                 f"*.lora_B.weight)")
            module = found["module"]
            if module.rsplit(".", 1)[-1] not in TARGETS:
                raise ValueError(f"LoRA adapter {path!r} adapts {module}; vserve serves adapters of "
                                 f"{', '.join(TARGETS)} only")
            shapes.setdefault(module, {})[found["ab"]] = tuple(f.get_slice(key).get_shape())
    if not shapes:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA tensors")
    rank = 0
    for module, ab in shapes.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_{'A' if 'A' in ab else 'B'} only")
        r = ab["A"][0]
        if ab["B"][1] != r:
            raise ValueError(f"LoRA adapter {path!r}: {module}'s lora_A {ab['A']} and lora_B {ab['B']} disagree")
        rank = max(rank, r)
        if model_config is not None:
            want = _module_shape(module, model_config)
            if want is None:
                raise ValueError(f"LoRA adapter {path!r} adapts {module}, which this model does not have")
            if (ab["B"][0], ab["A"][1]) != want:
                raise ValueError(f"LoRA adapter {path!r}: {module} is {ab['B'][0]}x{ab['A'][1]} (out x in), this "
                                 f"model's is {want[0]}x{want[1]}: the adapter was trained for another model")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank}, above --max-lora-rank {max_lora_rank}")
    return AdapterInfo(str(folder), rank, tuple(sorted(shapes)))


def _module_shape(module: str, mc) -> tuple[int, int] | None:
    """(out, in) features of a Llama-like model's projection, or None when the model has no such module."""
    found = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)", module)
    if found is None or int(found[1]) >= mc.num_hidden_layers:
        return None
    h, q, kv, inter = (mc.hidden_size, mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim,
                       mc.intermediate_size)
    shapes = {"self_attn": {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)},
              # MoE experts and StarCoder2's plain c_fc/c_proj MLP are not adapted
              "mlp": {} if getattr(mc, "num_experts", 0) or mc.architecture == "Starcoder2ForCausalLM" else
              {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}}
    return shapes[found[2]].get(found[3])


def load_adapter(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A [r, in], B [out, r] times the scaling), float32 on the CPU."""
    from safetensors.torch import load_file

    folder = Path(path).expanduser()
    cfg = _config(folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        found = _KEY.match(key)
        assert found is not None, key  # inspect_adapter checked the names
        parts.setdefault(found["module"], {})[found["ab"]] = t.float()
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    out = {}
    for module, ab in parts.items():
        r = ab["A"].shape[0]  # per module (PEFT's rank_pattern)
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out[module] = (ab["A"], ab["B"] * scaling)
    return out
