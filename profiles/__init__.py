"""GPU profiles: one YAML per GPU (datasheet figures, recommended engine settings), validated on load."""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from vserve.core.memory import QUANTIZATIONS, GiB

PROFILES_DIR = Path(__file__).resolve().parent
SIZE_CLASSES = ("8b", "14b", "34b", "72b", "moe")
# A class covers models up to 10% above its nominal size (Llama-3-8B has 8.03B parameters, Qwen2.5-14B 14.8B).
CLASS_LIMITS = (("8b", 8.8e9), ("14b", 15.4e9), ("34b", 37.4e9), ("72b", 79.2e9))
ENGINE_KEYS = ("block_size", "gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs")
TFLOPS_KEYS = ("fp16", "bf16", "fp8", "int8")


@dataclass(frozen=True)
class ModelRecommendation:
    tensor_parallel_size: int
    quantization: str | None


@dataclass(frozen=True)
class GpuProfile:
    """One GPU (one device as torch sees it): datasheet figures and what to run on it."""

    name: str
    display_name: str
    vendor: str  # nvidia | amd
    architecture: str
    match: tuple[str, ...]  # regexes (case-insensitive) that recognise the device name NVML / ROCm report
    memory_gb: float  # as the datasheet states it
    memory_type: str
    ecc_reserves_memory: bool  # GDDR6 with ECC on keeps 1/16 for check bits (HBM's ECC costs no capacity)
    memory_bandwidth_gbps: float
    dense_tflops: dict[str, float | None]  # fp16, bf16, fp8, int8 (TOPS), without sparsity
    fp8: bool
    interconnect: str
    datasheet: str
    engine: dict[str, int | float]  # EngineConfig fields: block_size, gpu_memory_utilization, ...
    models: dict[str, ModelRecommendation]  # size class -> tensor-parallel size and quantization
    devices_per_board: int = 1
    path: str = ""

    @property
    def memory_bytes(self) -> int:
        """Memory a process can use: the datasheet's (binary) GB, less the ECC reserve on GDDR cards."""
        total = int(self.memory_gb * GiB)
        return total - total // 16 if self.ecc_reserves_memory else total

    def as_dict(self) -> dict:
        d = asdict(self)
        d["match"] = list(self.match)
        d["memory_bytes"] = self.memory_bytes
        return d


def _positive(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


def _int(v, low: int = 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _text(v) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _regexes(v) -> bool:
    if not isinstance(v, list) or not v or not all(isinstance(p, str) for p in v):
        return False
    try:
        for p in v:
            re.compile(p)
    except re.error:
        return False
    return True


def _check_engine(v) -> str | None:
    from vserve.core.config import BLOCK_SIZES

    rules = {"block_size": (lambda x: x in BLOCK_SIZES, f"one of {', '.join(map(str, BLOCK_SIZES))}"),
             "gpu_memory_utilization": (lambda x: _positive(x) and x <= 1, "in (0, 1]"),
             "max_num_batched_tokens": (_int, "an integer >= 1"),
             "max_num_seqs": (_int, "an integer >= 1")}
    return _check_mapping(v, rules, "engine")


def _check_models(v) -> str | None:
    quant = (None, *QUANTIZATIONS)
    rec = {"tensor_parallel_size": (lambda x: _int(x) and x & (x - 1) == 0, "a power of two >= 1"),
           "quantization": (lambda x: x in quant, f"null or one of {', '.join(QUANTIZATIONS)}")}
    return _check_mapping(v, {c: (lambda x, c=c: _check_mapping(x, rec, f"models.{c}"), None) for c in SIZE_CLASSES},
                          "models")


def _check_tflops(v) -> str | None:
    rule = (lambda x: x is None or _positive(x), "null or a number > 0")
    return _check_mapping(v, dict.fromkeys(TFLOPS_KEYS, rule), "dense_tflops")


# key -> (check, rule text); rule None: a nested mapping whose check returns the problem (or None)
FIELDS = {
    "name": (_text, "a non-empty string"),
    "display_name": (_text, "a non-empty string"),
    "vendor": (lambda v: v in ("nvidia", "amd"), "nvidia or amd"),
    "architecture": (_text, "a non-empty string"),
    "match": (_regexes, "a non-empty list of regular expressions"),
    "memory_gb": (_positive, "a number > 0"),
    "memory_type": (_text, "a non-empty string"),
    "ecc_reserves_memory": (lambda v: isinstance(v, bool), "true or false"),
    "memory_bandwidth_gbps": (_positive, "a number > 0"),
    "dense_tflops": (_check_tflops, None),
    "fp8": (lambda v: isinstance(v, bool), "true or false"),
    "interconnect": (_text, "a non-empty string"),
    "datasheet": (lambda v: isinstance(v, str) and v.startswith("https://"), "an https:// URL"),
    "engine": (_check_engine, None),
    "models": (_check_models, None),
    "devices_per_board": (_int, "an integer >= 1"),
}
OPTIONAL = {"devices_per_board"}


def _check_mapping(value, rules: dict, prefix: str) -> str | None:
    """None when value is a mapping with exactly rules' keys, each passing; else 'key must be ..., got ...'."""
    if not isinstance(value, dict):
        return f"{prefix} must be a mapping, got {value!r}"
    for key in value:
        if key not in rules:
            name = f"{prefix}.{key}" if prefix else key
            return f"{name} is not a known key (known: {', '.join(rules)}), got {value[key]!r}"
    for key, (check, rule) in rules.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in value:
            if key in OPTIONAL and not prefix:
                continue
            return f"{name} is missing"
        if rule is None:  # a nested mapping: its check names the problem itself
            problem = check(value[key])
            if problem:
                return problem
        elif not check(value[key]):
            return f"{name} must be {rule}, got {value[key]!r}"
    return None


def load_profile(path: str | Path) -> GpuProfile:
    """Read and validate one profile; a bad one raises ValueError('<file>: <key> must be ..., got <value>')."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the profile: {e}") from None
    problem = _check_mapping(data, FIELDS, "")
    if problem is None and data["name"] != path.stem:
        problem = f"name must be the file's name {path.stem!r}, got {data['name']!r}"
    if problem is None and data["fp8"] != (data["dense_tflops"]["fp8"] is not None):
        problem = f"fp8 must agree with dense_tflops.fp8 ({data['dense_tflops']['fp8']!r}), got {data['fp8']!r}"
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    models = {c: ModelRecommendation(**r) for c, r in data.pop("models").items()}
    return GpuProfile(**{**data, "match": tuple(data["match"]), "models": models, "path": str(path)})


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


@functools.cache
def all_profiles() -> tuple[GpuProfile, ...]:
    return tuple(load_profile(PROFILES_DIR / f"{n}.yaml") for n in profile_names())


def get_profile(name: str) -> GpuProfile:
    for p in all_profiles():
        if p.name == name:
            return p
    raise ValueError(f"unknown GPU profile {name!r}; known: {', '.join(profile_names())}")


def size_class(num_params: int, moe: bool = False) -> str | None:
    """The recommendation class of a model: moe, or the first dense class it fits; None beyond 72B."""
    if moe:
        return "moe"
    return next((c for c, limit in CLASS_LIMITS if num_params <= limit), None)
