"""Paged KV cache bookkeeping: a block pool with ref counts, an O(1) free queue, prefix caching by hash chain."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from vserve.core.request import Request

BlockHash = bytes  # a SHA-256 digest


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks: pop from the head (LRU), append at the tail,
    remove from the middle in O(1) when a cached block is revived by a prefix hit."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} already free"
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"block {block.block_id} not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise RuntimeError("no free KV cache blocks")
        self.remove(block)
        return block

    def __iter__(self):
        b = self.head.next_free
        while b is not self.tail:
            yield b
            b = b.next_free


_ROOT_HASH = hashlib.sha256(b"vserve prefix cache v1").digest()  # the parent of a sequence's first block


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Chained block hash: SHA-256 over the parent's hash, the block's token ids (length-prefixed little-endian
    uint32) and its extra keys (a cache salt, later an adapter id). Equal hashes mean equal prefixes and keys; unlike
    Python's hash() of a tuple (vLLM's CVE-2025-25183) a client cannot craft a collision with another tenant's
    prefix, and the value is the same in every process and on every machine."""
    h = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    if extra_keys:
        h.update(json.dumps(extra_keys, separators=(",", ":")).encode())
    return h.digest()


class BlockPool:
    """All KV blocks, their ref counts, the free queue and the hash -> cached block map."""

    def __init__(self, num_blocks: int, enable_caching: bool, max_cached_free: int | None = None) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}
        self.enable_caching = enable_caching
        # --cache-size-gb: at most this many free blocks keep their hash (the prefix cache's resident size beyond
        # the blocks requests hold); the least recently freed lose it first. cached_free: those blocks, LRU first.
        self.max_cached_free = max_cached_free
        self.cached_free: dict[int, KVCacheBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks():
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks()} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict the LRU cached block
                self._uncache(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving those sitting in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.cached_free.pop(block.block_id, None)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the queue tail in the order given."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed with ref_cnt {block.ref_cnt}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if self.max_cached_free is not None and block.block_hash is not None:
                    self.cached_free[block.block_id] = block
                    while len(self.cached_free) > self.max_cached_free:
                        self._uncache(self.cached_free[next(iter(self.cached_free))])

    def _uncache(self, block: KVCacheBlock) -> None:
        """The block's contents are no longer found by hash (it stays where it is in the free queue)."""
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        self.cached_free.pop(block.block_id, None)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        # Keep an existing mapping: an identical block computed twice stays uncached the second time.
        self.cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks() != self.num_blocks:
            return False
        self.cached.clear()
        self.cached_free.clear()
        for b in self.blocks:
            b.block_hash = None
        return True


# Stands in a block table for a block released because it fell out of the sliding window: its id (0) is never read
# (the attention kernels read only a query's window), and it is never freed or cached.
OUT_OF_WINDOW = KVCacheBlock(0)


class BlockTables:
    """The block ids of every request that holds blocks, a row each in one preallocated array (grown by doubling),
    kept in step with the manager's block lists as blocks are appended, released out of the window or freed. A step
    gathers its requests' rows (`gather`, one numpy index) instead of rebuilding every table from Python lists
    (issue #24's persistent batch: 3.4 us a token at 256 rows on this project's CPU before)."""

    def __init__(self, rows: int = 64, cols: int = 16) -> None:
        self.ids = np.zeros((rows, cols), dtype=np.int64)
        self.lens = np.zeros(rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(rows - 1, -1, -1))

    def row(self, request_id: str) -> int:
        row = self.row_of.get(request_id)
        if row is None:
            if not self.free_rows:
                n = len(self.lens)
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
                self.free_rows = list(range(2 * n - 1, n - 1, -1))
            row = self.row_of[request_id] = self.free_rows.pop()
        return row

    def write(self, request_id: str, start: int, blocks: Sequence[KVCacheBlock]) -> None:
        """Entries start.. of the request's row become these blocks' ids (the row is at least that long after)."""
        row, end = self.row(request_id), start + len(blocks)
        if end > self.ids.shape[1]:
            width = max(end, 2 * self.ids.shape[1])
            self.ids = np.concatenate([self.ids, np.zeros((len(self.ids), width - self.ids.shape[1]), np.int64)], 1)
        if end - start == 1:  # a decode's new block: numpy scalar stores (a list store costs ~5x)
            self.ids[row, start] = blocks[0].block_id
        else:
            self.ids[row, start:end] = [b.block_id for b in blocks]
        if self.lens[row] < end:
            self.lens[row] = end

    def drop(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.lens[row] = 0
            self.free_rows.append(row)

    def gather(self, request_ids: Iterable[str]) -> np.ndarray:
        """[requests, longest of their tables] block ids (a copy; entries past a shorter table are stale)."""
        rows = np.fromiter((self.row_of[r] for r in request_ids), np.int64)
        width = int(self.lens[rows].max()) if len(rows) else 0
        return self.ids[rows, :max(width, 1)]


class KVCacheManager:
    """Per-request block tables on top of the pool; the scheduler's only view of the KV cache.

    sliding_window (a model whose every layer slides; ModelConfig.kv_window()): blocks wholly before the window of
    the next token to compute are released as soon as the request moves past them (vLLM's sliding-window manager,
    without its hybrid allocator: a model with any full-attention layer keeps every block)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None, longrope_original: int | None = None,
                 max_cached_free_blocks: int | None = None) -> None:
        self.block_size = block_size
        # LongRoPE (Phi-3): a prompt longer than this rotates every key with the long factors, a shorter one its first
        # keys with the short ones, so their blocks must never be shared: the long ones hash with an extra key
        self.longrope_original = longrope_original
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.num_released: dict[str, int] = {}  # leading blocks of a request released (out of the window)
        self.pool = BlockPool(num_blocks, enable_caching, max_cached_free_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.tables = BlockTables()  # the same lists' block ids, a row each: what a step gathers
        self.num_cached_blocks: dict[str, int] = {}
        # request id -> the token count its blocks reach with no block to allocate and none newly full to cache:
        # the scheduler skips allocate_slots for a step that stays within it (every decode step but one a block).
        # Not kept where blocks slide out of the window (each step may release one).
        self.room: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def _update_block_hashes(self, req: Request) -> None:
        bs = self.block_size
        hashes = req.block_hashes
        while (len(hashes) + 1) * bs <= req.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            # The salt keys the first block; the chain carries it to every later one.
            extra = (req.cache_salt,) if i == 0 and req.cache_salt is not None else ()
            if i == 0 and req.lora_id:  # two adapters never share KV (nor an adapter and the base model)
                extra += (f"lora:{req.lora_id}",)
            if i == 0 and self.longrope_original is not None and req.num_prompt_tokens > self.longrope_original:
                extra += ("longrope-long",)
            hashes.append(hash_block_tokens(parent, req.all_token_ids[i * bs:(i + 1) * bs], extra))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks. The last token is always recomputed: its logits are needed; so is
        every token of a request that wants prompt logprobs (it reads no cached block)."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Reserve blocks for `num_new_tokens` more tokens; None (and nothing changed) if they don't fit."""
        rid = req.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
        bs = self.block_size
        if self.sliding_window is not None and blocks:
            self._release_outside_window(rid, blocks, req.num_computed_tokens)
        total_tokens = req.num_computed_tokens + num_new_tokens
        if not new_computed_blocks and total_tokens <= len(blocks) * bs and (
                not self.enable_caching or min(total_tokens, len(req.all_token_ids)) // bs
                <= self.num_cached_blocks.get(rid, 0)):
            self._set_room(rid, blocks)
            return []  # the common decode step: room in the last block, no block newly full
        new_computed_blocks = new_computed_blocks or []
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * bs
        total_tokens = num_computed + num_new_tokens
        num_required = -(-total_tokens // bs)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Hit blocks with ref_cnt 0 sit in the free queue: taking them shrinks what is free.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks() - num_revived:
            if not blocks:
                del self.req_to_blocks[rid]
            return None
        self.pool.touch(new_computed_blocks)
        had = len(blocks)
        blocks.extend(new_computed_blocks)
        if self.sliding_window is not None:  # prefix hits older than the window go straight back
            self._release_outside_window(rid, blocks, num_computed)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        self.tables.write(rid, had, blocks[had:])
        if self.enable_caching:
            self._cache_full_blocks(req, blocks, total_tokens)
        self._set_room(rid, blocks)
        return new_blocks

    def _set_room(self, rid: str, blocks: list[KVCacheBlock]) -> None:
        """room[rid]: a step reaching at most this many tokens needs nothing of allocate_slots (its fast path holds:
        the tokens fit the blocks, and with caching no block beyond those cached becomes full)."""
        if self.sliding_window is None:
            room = len(blocks) * self.block_size
            if self.enable_caching:
                room = min(room, (self.num_cached_blocks.get(rid, 0) + 1) * self.block_size - 1)
            self.room[rid] = room

    def _cache_full_blocks(self, req: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Only tokens whose ids are known can be hashed; a decode step's new slot is filled next step.
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(req)
        for i in range(start, num_full):
            if blocks[i] is not OUT_OF_WINDOW:
                self.pool.cache_block(blocks[i], req.block_hashes[i])
        self.num_cached_blocks[req.request_id] = num_full

    def _release_outside_window(self, request_id: str, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Release the blocks wholly before the window of position num_computed (the next token computed): no
        later query reads them. They keep their hashes, so a later prompt with the same prefix may still hit them."""
        n = min(max(0, num_computed - self.sliding_window + 1) // self.block_size, len(blocks))
        start = self.num_released.get(request_id, 0)
        if n <= start:
            return
        released = blocks[start:n]
        blocks[start:n] = [OUT_OF_WINDOW] * (n - start)
        self.tables.write(request_id, start, blocks[start:n])
        self.pool.free_blocks(released)  # oldest first: evicted first
        self.num_released[request_id] = n

    def free(self, req: Request) -> None:
        # Reverse order: a sequence's tail blocks are evicted before its (more shareable) head blocks.
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.tables.drop(req.request_id)
        self.pool.free_blocks(b for b in reversed(blocks) if b is not OUT_OF_WINDOW)
        self.num_cached_blocks.pop(req.request_id, None)
        self.num_released.pop(req.request_id, None)
        self.room.pop(req.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def block_table(self, reqs: Sequence[Request]) -> np.ndarray:
        """These requests' block ids, a row each ([requests, longest table]; a shorter row's tail is stale)."""
        return self.tables.gather(r.request_id for r in reqs)

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks()

    def usage(self) -> float:
        return self.pool.usage()
