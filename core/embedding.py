"""Sentence embeddings from a BERT-family folder: tokenize, encode in padded batches, pool, L2-normalise."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.nn import functional as F

from vserve.core.loader import DTYPES, count_safetensors, iter_safetensors, load_weights, safetensors_files
from vserve.core.model_config import BERT_ARCHITECTURES, is_embedding_model
from vserve.core.models.bert import BertConfig, BertModel
from vserve.ops.progress import progress_bar

POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_max_tokens": "max"}
_ST = "sentence_transformers.models."


def read_sentence_transformers_modules(path: Path) -> tuple[str, bool]:
    """(pooling, normalize) by the sentence-transformers convention: modules.json + <pooling dir>/config.json.

    A plain HF folder (no modules.json) gets mean pooling and no normalisation, as sentence-transformers
    gives it.
    """
    modules = json.loads((path / "modules.json").read_text()) if (path / "modules.json").exists() else []
    pooling_dir, normalize = "1_Pooling", False
    for m in modules:
        kind = m.get("type", "").removeprefix(_ST)
        if kind == "Pooling":
            pooling_dir = m.get("path") or pooling_dir
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"{path}/modules.json lists a {m.get('type')!r} module, which vserve does not support "
                             f"(only Transformer, Pooling and Normalize)")
    pooling_cfg = path / pooling_dir / "config.json"
    if not pooling_cfg.exists():
        return "mean", normalize
    cfg = json.loads(pooling_cfg.read_text())
    on = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True)
    if len(on) != 1 or on[0] not in POOLING_MODES:
        raise ValueError(f"{pooling_cfg} turns on {on or 'no pooling mode'}; vserve supports exactly one of "
                         f"{', '.join(POOLING_MODES)}")
    return POOLING_MODES[on[0]], normalize


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """[B, T, H] hidden states and [B, T] 0/1 mask -> [B, H] float32, over the real (non-padding) tokens only."""
    hidden, m = hidden.float(), mask[:, :, None].bool()
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(~m, float("-inf")).amax(dim=1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1)


class EmbeddingEngine:
    """One vector per input; `embed` is safe to call from several threads (one batch runs at a time)."""

    def __init__(self, model_path: str | Path, dtype: str = "float32", device: str = "cpu",
                 max_batch_size: int = 64) -> None:
        from transformers import AutoTokenizer

        path = Path(model_path).expanduser()
        if not is_embedding_model(path):
            raise ValueError(f"{model_path} is not a BERT embedding model (config.json architectures must be one of "
                             f"{', '.join(BERT_ARCHITECTURES)})")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        files = safetensors_files(path)
        if not files:
            raise ValueError(f"no .safetensors weights in {model_path} (pickled .bin weights are refused)")
        self.config = BertConfig.from_dict(json.loads((path / "config.json").read_text()))
        self.pooling, self.normalize = read_sentence_transformers_modules(path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        # model_max_length is a huge sentinel when the tokenizer does not set it
        self.max_model_len = min(self.config.max_position_embeddings, self.tokenizer.model_max_length)
        self.dim = self.config.hidden_size
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        model = BertModel(self.config)
        load_weights(model, progress_bar(_renamed(iter_safetensors(files)), count_safetensors(files),
                                         "Loading weights"))
        self.model = model.to(device=self.device, dtype=DTYPES[dtype]).eval()
        self._lock = threading.Lock()

    def embed(self, inputs: list[str] | list[list[int]]) -> tuple[list[list[float]], int]:
        """(one vector per input, in order; total tokens including special tokens). ValueError for bad input."""
        if not isinstance(inputs, list) or not inputs:
            raise ValueError("inputs must be a non-empty list of strings or token-id lists")
        with self._lock:  # the fast tokenizer and the model are shared state
            ids = self._tokenize(inputs)
            vectors = self._encode(ids)
        return vectors.tolist(), sum(len(x) for x in ids)

    def _tokenize(self, inputs: list) -> list[torch.Tensor]:
        texts = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        encoded = self.tokenizer([inputs[i] for i in texts], verbose=False)["input_ids"] if texts else []
        ids: list[torch.Tensor] = [None] * len(inputs)  # type: ignore[list-item]
        for i, enc in zip(texts, encoded):
            ids[i] = torch.tensor(enc, dtype=torch.long)
        for i, x in enumerate(inputs):
            if ids[i] is None:
                ids[i] = self._check_token_ids(i, x)
            if len(ids[i]) > self.max_model_len:
                raise ValueError(f"input {i} has {len(ids[i])} tokens, more than the model's maximum of "
                                 f"{self.max_model_len}")
        return ids

    def _check_token_ids(self, i: int, x) -> torch.Tensor:
        t = torch.tensor(x) if isinstance(x, list | tuple) else None
        if t is None or t.ndim != 1 or (len(t) and t.dtype != torch.long):
            raise ValueError(f"input {i} must be a string or a list of token ids, got {type(x).__name__}")
        if len(t) == 0:
            raise ValueError(f"input {i} is an empty token-id list")
        if int(t.min()) < 0 or int(t.max()) >= self.config.vocab_size:
            raise ValueError(f"input {i} has token ids outside [0, {self.config.vocab_size})")
        return t

    @torch.inference_mode()
    def _encode(self, ids: list[torch.Tensor]) -> torch.Tensor:
        out = torch.empty(len(ids), self.dim)
        # longest first, so each batch pads to lengths close to its own
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        for start in range(0, len(order), self.max_batch_size):
            batch = order[start:start + self.max_batch_size]
            T = len(ids[batch[0]])
            input_ids = torch.full((len(batch), T), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros(len(batch), T, dtype=torch.long)
            for row, i in enumerate(batch):
                input_ids[row, :len(ids[i])] = ids[i]
                mask[row, :len(ids[i])] = 1
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            vectors = pool(self.model(input_ids, mask), mask, self.pooling)
            if self.normalize:
                vectors = F.normalize(vectors, p=2, dim=-1)
            out[batch] = vectors.cpu()
        return out


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        ours = BertModel.checkpoint_name(name)
        if ours is not None:
            yield ours, tensor
