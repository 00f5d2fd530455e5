"""Batched multi-LoRA references (the CPU path): shrink (x·Aᵀ) and expand (·Bᵀ added into the base output) over
rows that each name their adapter's slot (-1: no adapter, left untouched).

Adapters are stacked by slot: `lora_a` [slots, L*R, K] holds a packed layer's L slices' A matrices one under the
other (R rows each, zero-padded past an adapter's rank), `lora_b` [slots, N, R] the B matrices (already multiplied by
the adapter's scaling) stacked along the output features, slice j covering output columns bounds[j]:bounds[j+1].
The Triton kernels (triton_lora.py) take the same arguments."""

from __future__ import annotations

from typing import NamedTuple

import torch

TILE_M = 16  # rows of one slot a Triton program takes (triton_lora's BLOCK_M)


class LoRAMapping(NamedTuple):
    """A step's rows grouped by adapter slot, built once per step on the device (no host sync, graph-capturable):
    token_order lists the rows sorted by slot (rows without adapter first), slot_counts[s + 1] / slot_starts[s + 1]
    how many of them slot s has and where they begin in token_order (index 0: rows without adapter).

    The Triton kernels' row tiles: tile p takes TILE_M rows of slot tile_slot[p], from its tile_row[p]-th on (a tile
    with tile_slot[p] == num_slots has none). Their count, num_tiles(T, num_slots), depends on the sizes alone, so a
    kernel's grid does too; launched over every (row block, slot) instead, a decode step of 256 rows over 8 slots ran
    8x the programs it needed, all but one in eight returning at once, and 32 slots 32x."""

    slots: torch.Tensor  # [T] int64, -1: no adapter
    token_order: torch.Tensor  # [T]
    slot_counts: torch.Tensor  # [num_slots + 1]
    slot_starts: torch.Tensor  # [num_slots + 1]
    tile_slot: torch.Tensor  # [num_tiles(T, num_slots)]
    tile_row: torch.Tensor  # [num_tiles(T, num_slots)]


def num_tiles(num_rows: int, num_slots: int) -> int:
    """Tiles enough for any grouping: sum over slots of ceil(count / TILE_M) <= ceil(T / TILE_M) + (slots with
    rows)."""
    return -(-num_rows // TILE_M) + min(num_slots, num_rows)


def lora_mapping(slots: torch.Tensor, num_slots: int) -> LoRAMapping:
    dev = slots.device
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, slots + 1, torch.ones_like(slots))  # not bincount: its output size syncs with the host
    order = torch.argsort(slots, stable=True)
    tiles = (counts[1:] + TILE_M - 1) // TILE_M  # each slot's tiles
    ends = torch.cumsum(tiles, 0)
    p = torch.arange(num_tiles(slots.shape[0], num_slots), device=dev)
    tile_slot = torch.searchsorted(ends, p, right=True)  # num_slots past the last tile
    first = (ends - tiles).gather(0, tile_slot.clamp(max=num_slots - 1))
    return LoRAMapping(slots, order, counts, torch.cumsum(counts, 0) - counts, tile_slot, (p - first) * TILE_M)


def _groups(m: LoRAMapping):
    """(slot, its rows) for each slot with rows; host-side (the reference only)."""
    counts, starts = m.slot_counts.tolist(), m.slot_starts.tolist()
    for s in range(len(counts) - 1):
        if counts[s + 1]:
            yield s, m.token_order[starts[s + 1]:starts[s + 1] + counts[s + 1]]


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, m: LoRAMapping, partial: bool = False) -> torch.Tensor:
    """[T, K] · each row's slot's A [L*R, K]ᵀ -> [T, L*R] float32 (rows without adapter: zeros). partial: the Triton
    kernel may then return split-K partial sums [splits, T, L*R] for lora_expand to add up; here there is one."""
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for s, rows in _groups(m):
        out[rows] = x[rows].float() @ lora_a[s].float().T
    return out.unsqueeze(0) if partial else out


def lora_expand_ref(buf: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, m: LoRAMapping,
                    bounds: tuple[int, ...]) -> None:
    """out[row, bounds[j]:bounds[j+1]] += buf[row, j*R:(j+1)*R] · B_j[slot]ᵀ for every row with an adapter (in
    place; rows without one untouched). R = lora_b.shape[2]; buf [splits, T, L*R]: partial sums, added first."""
    if buf.dim() == 3:
        buf = buf.sum(0)
    R = lora_b.shape[2]
    for s, rows in _groups(m):
        for j in range(len(bounds) - 1):
            lo, hi = bounds[j], bounds[j + 1]
            delta = buf[rows, j * R:(j + 1) * R].float() @ lora_b[s, lo:hi].float().T
            out[rows, lo:hi] += delta.to(out.dtype)
