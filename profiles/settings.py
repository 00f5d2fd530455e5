"""A profile's recommended engine settings for one model: the profile's engine block, plus TP and quantization
by the model's size class. EngineConfig.resolve applies what the engine supports and reports the rest."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from vserve.profiles import GpuProfile, size_class
from vserve.profiles.detect import GpuInfo, resolve_profile

log = logging.getLogger("vserve.profiles")
_warned: set[str] = set()


@dataclass
class ProfileSettings:
    profile: GpuProfile
    values: dict[str, object]  # EngineConfig field -> the profile's value
    size_class: str | None = None
    num_params: int | None = None
    notes: list[str] = field(default_factory=list)  # a fallback profile, a model whose size is unknown

    @property
    def label(self) -> str:
        return f"profile {self.profile.name}"


def model_size(model: str | None) -> tuple[int, bool]:
    """(parameters, is MoE) of a model folder, config.json, .gguf or shape name; None: the embedded default."""
    from vserve.core.memory import num_params
    from vserve.ops.model_shapes import known_shape, moe_shape, read_model_config

    if model is None:
        return num_params(known_shape("smollm2-135m")), False
    if Path(model).suffix == ".gguf" and Path(model).is_file():
        import gguf

        try:
            tensors = gguf.GGUFReader(model).tensors
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read GGUF file {model}: {e}") from None
        return sum(int(t.n_elements) for t in tensors), any("_exps" in t.name for t in tensors)
    cfg = read_model_config(model)
    return num_params(cfg), moe_shape(cfg) is not None


def settings_for(profile: GpuProfile, model: str | None) -> ProfileSettings:
    out = ProfileSettings(profile, dict(profile.engine))
    try:
        out.num_params, moe = model_size(model)
    except ValueError as e:
        out.notes.append(f"{out.label}: no size-class recommendation ({e})")
        return out
    out.size_class = size_class(out.num_params, moe)
    if out.size_class is None:
        out.notes.append(f"{out.label}: no size class covers {out.num_params / 1e9:.0f}B parameters; "
                         "plan TP and quantization with `vserve doctor`")
        return out
    rec = profile.models[out.size_class]
    out.values.update(tensor_parallel_size=rec.tensor_parallel_size, quantization=rec.quantization)
    return out


def profile_settings(name: str, model: str | None, gpus: tuple[GpuInfo, ...] | None = None) -> ProfileSettings:
    """--profile NAME|auto for a model; an unknown GPU's fallback is logged once and kept in notes."""
    profile, warning = resolve_profile(name, gpus)
    out = settings_for(profile, model)
    if warning:
        out.notes.insert(0, warning)
        if warning not in _warned:
            _warned.add(warning)
            log.warning(warning)
    return out
