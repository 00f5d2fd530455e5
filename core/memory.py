"""Memory planner: bytes of KV per token and block, and how many KV blocks a memory budget holds."""

from __future__ import annotations

import os

from vserve.core.model_config import ModelConfig

GiB = 1 << 30


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    return cfg.kv_bytes_per_token(dtype_bytes) * block_size


def default_cpu_kv_budget() -> int:
    """1 GiB (tens of thousands of tokens for small models), or a quarter of the free memory if less."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 16 * GiB
    return min(GiB, avail // 4)


def plan_num_blocks(cfg: ModelConfig, block_size: int, dtype_bytes: int, budget_bytes: int,
                    max_model_len: int) -> int:
    """Blocks that fit in the budget; refuses a cache that cannot hold one max_model_len sequence."""
    per_block = kv_bytes_per_block(cfg, block_size, dtype_bytes)
    num_blocks = budget_bytes // per_block
    check_fits_one_sequence(num_blocks, block_size, max_model_len, per_block)
    return num_blocks


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def check_fits_one_sequence(num_blocks: int, block_size: int, max_model_len: int, per_block: int) -> None:
    need = -(-max_model_len // block_size)
    if num_blocks < need:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens, "
            f"{fmt_bytes(num_blocks * per_block)}) but one --max-model-len {max_model_len} sequence needs "
            f"{need} blocks ({fmt_bytes(need * per_block)}); lower --max-model-len or give the cache more memory"
        )
