"""Benchmark workloads as token ids: random, a prompts file, a chat-like length mix, a shared-prefix mix. No torch."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "file", "chat", "prefix")


@dataclass
class Workload:
    """The same requests for every backend: prompt token ids and each request's output length.

    `texts` holds the prompts as written for a prompts file (sent as-is by `bench serve`).
    """

    prompts: list[list[int]]
    output_lens: list[int]
    texts: list[str] | None = None


def parse_len(flag: str, value: str) -> tuple[int, int]:
    """'A' or 'A:B' -> (A, B) with 1 <= A <= B."""
    try:
        lo, _, hi = value.partition(":")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise ValueError(f"{flag} must be N or A:B with 1 <= A <= B, got {value!r}")
    return a, b


def _allowed(vocab_size: int, special_ids: set[int]) -> list[int]:
    return [t for t in range(vocab_size) if t not in special_ids]


def random_workload(seed: int, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, special_ids: set[int]) -> Workload:
    """Uniform lengths in [A, B]; token ids uniform over the vocabulary minus special tokens."""
    rng = random.Random(seed)
    allowed = _allowed(vocab_size, special_ids)
    prompts = [rng.choices(allowed, k=rng.randint(*input_len)) for _ in range(num_prompts)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_prompts)])


def chat_workload(seed: int, num_prompts: int, vocab_size: int, special_ids: set[int],
                  max_len: int | None = None) -> Workload:
    """ShareGPT-like lengths: log-normal prompts (median 180 tokens) and outputs (median 150), clipped.

    Medians and spreads follow the ShareGPT set vLLM benchmarks with (mean prompt ~220, output ~200 tokens);
    each request's prompt + output is clipped to `max_len`.
    """
    rng = random.Random(seed)
    allowed = _allowed(vocab_size, special_ids)
    prompts, outs = [], []
    for _ in range(num_prompts):
        p = min(2048, max(4, round(rng.lognormvariate(math.log(180), 0.9))))
        o = min(1024, max(4, round(rng.lognormvariate(math.log(150), 0.8))))
        if max_len is not None and p + o > max_len:
            p = max(1, p * max_len // (p + o))
            o = max(1, max_len - p)
        prompts.append(rng.choices(allowed, k=p))
        outs.append(o)
    return Workload(prompts, outs)


def prefix_workload(seed: int, num_prompts: int, prefix_len: int, num_prefixes: int, suffix_len: tuple[int, int],
                    output_len: tuple[int, int], vocab_size: int, special_ids: set[int]) -> Workload:
    """Request i = prefix[i % num_prefixes] (prefix_len random tokens) + its own random suffix."""
    if prefix_len < 1 or num_prefixes < 1:
        raise ValueError(f"--prefix-len and --num-prefixes must be >= 1, got {prefix_len} and {num_prefixes}")
    rng = random.Random(seed)
    allowed = _allowed(vocab_size, special_ids)
    prefixes = [rng.choices(allowed, k=prefix_len) for _ in range(num_prefixes)]
    prompts = [prefixes[i % num_prefixes] + rng.choices(allowed, k=rng.randint(*suffix_len))
               for i in range(num_prompts)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_prompts)])


def file_workload(path: Path, seed: int, num_prompts: int, output_len: tuple[int, int],
                  encode: Callable[[str], list[int]]) -> Workload:
    """The file's prompts (.txt lines or .jsonl {"prompt": ...}), cycled to num_prompts, in order."""
    from vserve.cli.generate import read_prompts  # no torch

    if not Path(path).is_file() or Path(path).suffix not in (".txt", ".jsonl"):
        raise ValueError(f"--dataset-path must be an existing .txt or .jsonl file, got {str(path)!r}")
    items = read_prompts(Path(path))
    texts = [i for i in items if isinstance(i, str)]
    if not texts:
        raise ValueError(f"--dataset-path {str(path)!r} holds no prompts (conversations are not supported here)")
    rng = random.Random(seed)
    texts = [texts[i % len(texts)] for i in range(num_prompts)]
    return Workload([encode(t) for t in texts], [rng.randint(*output_len) for _ in texts], texts)


def make_workload(dataset: str, *, seed: int, num_prompts: int, input_len: tuple[int, int],
                  output_len: tuple[int, int], vocab_size: int, special_ids: set[int],
                  encode: Callable[[str], list[int]], dataset_path: str | None = None, prefix_len: int = 256,
                  num_prefixes: int = 1, max_len: int | None = None) -> Workload:
    """The one entry point the bench commands call, by --dataset name."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if dataset == "random":
        return random_workload(seed, num_prompts, input_len, output_len, vocab_size, special_ids)
    if dataset == "chat":
        return chat_workload(seed, num_prompts, vocab_size, special_ids, max_len)
    if dataset == "prefix":
        return prefix_workload(seed, num_prompts, prefix_len, num_prefixes, input_len, output_len, vocab_size,
                               special_ids)
    if dataset == "file":
        if not dataset_path:
            raise ValueError("--dataset file needs --dataset-path prompts.txt|.jsonl")
        return file_workload(Path(dataset_path), seed, num_prompts, output_len, encode)
    raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
