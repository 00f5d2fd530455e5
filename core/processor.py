"""InputProcessor: tokenize and validate prompts into Requests; what the API process needs of an engine.

It holds the tokenizer, the model config and the limits, never the weights, so the server's process can
validate and tokenize while the engine runs in another one (core/engine_core.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from vserve.core.config import EngineConfig
from vserve.core.model_config import ModelConfig, model_source
from vserve.core.request import Request
from vserve.core.sampling_params import SamplingParams
from vserve.core.structured_output import GrammarCompiler
from vserve.ops import startup

# The model types of SUPPORTED_ARCHITECTURES for which AutoTokenizer takes a tokenizer_config.json's generic class as
# it is (tests/test_front_end_imports.py checks each against the installed transformers). Not qwen2: transformers
# loads Qwen2Tokenizer for it whatever the folder names, as it does for a folder naming Qwen2Tokenizer.
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gemma",
    "gemma2", "gemma3_text", "phi3", "cohere", "cohere2", "starcoder2"})
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_QWEN2_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast")
QWEN_MODEL_TYPES = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})  # where checkpoints name Qwen2Tokenizer


def direct_tokenizer_class(path: Path):
    """The transformers class AutoTokenizer would load the folder with, imported without AutoTokenizer, or None:
    TokenizersBackend for a generic class name (TokenizersBackend, PreTrainedTokenizerFast) under a model type whose
    hub class AutoTokenizer trusts, Qwen2Tokenizer for a Qwen folder naming it or a generic class under qwen2. Only
    where tokenizer.json holds the whole tokenizer and there is no custom code (auto_map). AutoTokenizer's own
    imports (the model config classes and torch) were 2.2 s of the front end's start on this project's CPU, its
    largest phase (docs/performance.md)."""
    try:
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type") if (
            path / "config.json").exists() else None
    except (OSError, ValueError):
        return None
    declared = tok_cfg.get("tokenizer_class")
    if "auto_map" in tok_cfg or not (path / "tokenizer.json").is_file():
        return None
    if (declared in _QWEN2_CLASSES and (model_type is None or model_type in QWEN_MODEL_TYPES)
            or declared in _GENERIC_CLASSES and model_type == "qwen2"):
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

        return Qwen2Tokenizer
    if declared in _GENERIC_CLASSES and (model_type is None or model_type in GENERIC_TOKENIZER_MODEL_TYPES):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend
    return None


def load_tokenizer(path: Path, fmt: str, trust_remote_code: bool):
    if fmt == "gguf":
        from vserve.core.gguf_file import gguf_tokenizer

        return gguf_tokenizer(path)
    cls, kwargs = direct_tokenizer_class(path) if path.is_dir() else None, {}  # no remote code: no auto_map there
    if cls is None:
        from transformers import AutoTokenizer

        cls, kwargs = AutoTokenizer, {"trust_remote_code": trust_remote_code}
    try:
        return cls.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from None


def max_model_len_for(config: EngineConfig, mc: ModelConfig) -> int:
    limit = mc.max_position_embeddings  # sliding-window layers attend past their window (kernels' window=)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's context length {limit}")
    return config.max_model_len


class InputProcessor:
    """Prompts (text or token ids) and SamplingParams -> the n child Requests of one request, or ValueError."""

    def __init__(self, config: EngineConfig, path: Path, fmt: str, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.max_model_len = max_model_len_for(config, model_config)
        with startup.phase("tokenizer"):
            self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
                Path(config.tokenizer) if config.tokenizer else path, "hf" if config.tokenizer else fmt,
                config.trust_remote_code)
        self.stop_token_ids = self._stop_token_ids(path if fmt != "gguf" else None)
        self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size, self.stop_token_ids,
                                        backend=config.structured_outputs_backend)

    @classmethod
    def from_config(cls, config: EngineConfig) -> InputProcessor:
        return cls(config, *model_source(config))

    def _stop_token_ids(self, folder: Path | None) -> set[int]:
        ids = set(self.model_config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen = folder / "generation_config.json" if folder is not None else None
        if gen is not None and gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    @property
    def eos_token_id(self) -> int | None:
        if self.tokenizer is None:
            return self.model_config.eos_token_id[0] if self.model_config.eos_token_id else None
        return self.tokenizer.eos_token_id

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init): give prompts as token ids")
            return self.tokenizer(prompt).input_ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def make_requests(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      cache_salt: str | None = None) -> list[Request]:
        """Tokenize and validate (ValueError for bad input) without touching engine state. cache_salt: this
        request reuses cached prefix blocks only of requests with the same salt (vLLM's request field)."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        params.validate_for_vocab(self.model_config.vocab_size)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this engine has none (skip_tokenizer_init)")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room to generate within "
                             f"--max-model-len {self.max_model_len}")
        if params.max_tokens is not None and params.max_tokens > room:
            if not params.truncate_max_tokens:
                raise ValueError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                                 f"--max-model-len {self.max_model_len}")
        spec = None
        if params.structured_outputs is not None:
            spec = self.grammars.compile(params.structured_outputs)
        max_tokens = min(params.max_tokens or room, room)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.stop_token_ids
        return [Request(request_id=f"{request_id}-{i}" if params.n > 1 else request_id, prompt_token_ids=ids,
                        sampling_params=replace(params, seed=None if params.seed is None else params.seed + i, n=1,
                                                all_stop_token_ids=stops),
                        max_tokens=max_tokens, prompt=prompt if isinstance(prompt, str) else None,
                        parent_id=request_id, index=i, eos_token_id=None if params.ignore_eos else self.eos_token_id,
                        cache_salt=cache_salt, structured=spec)
                for i in range(params.n)]

    def core_commands(self, children: list[Request]) -> list[tuple]:
        """The commands that hand these requests to the core (with their grammars' compiled forms where the core
        lacks them: GrammarCompiler.core_commands)."""
        from vserve.core.messages import encode_request

        before, after = self.grammars.core_commands(children)
        return [*before, ("add", [encode_request(r) for r in children]), *after]
