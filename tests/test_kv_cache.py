"""Block pool and KV cache manager: ref counts, the free queue and prefix caching, as specified behaviour."""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
import subprocess
import sys
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vserve.core.kv_cache import BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager, hash_block_tokens
from vserve.core.request import Request
from vserve.core.sampling_params import SamplingParams

BS = 4  # block size of every test here: small, so a few tokens cross block boundaries


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(),
                   max_tokens=64, cache_salt=cache_salt)


def prefill(kv: KVCacheManager, req: Request) -> list[KVCacheBlock]:
    """What the scheduler does for a waiting request: prefix hits, slots for the rest, computed tokens."""
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return hits


def chain_hashes(token_ids: list[int]) -> list[bytes]:
    """Reference hash chain of the full blocks of token_ids."""
    out: list[bytes] = []
    for i in range(len(token_ids) // BS):
        out.append(hash_block_tokens(out[-1] if out else None, token_ids[i * BS:(i + 1) * BS]))
    return out


# ---- free queue ------------------------------------------------------------------------------------------


def test_free_queue_removes_a_middle_block_by_relinking_its_neighbours():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)

    q.remove(blocks[2])

    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.num_free_blocks == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]


def test_free_queue_pops_from_the_head_and_appends_at_the_tail():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)

    first = q.popleft()
    q.append(first)

    assert first.block_id == 0
    assert [b.block_id for b in q] == [1, 2, 0]
    assert q.num_free_blocks == 3


# ---- free order and eviction -----------------------------------------------------------------------------


def test_freed_request_blocks_join_the_free_queue_tail_in_reverse_order():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    req = make_request("a", list(range(10)))  # 3 blocks: 0, 1, 2
    prefill(kv, req)
    assert kv.get_block_ids("a") == [0, 1, 2]

    kv.free(req)

    assert [b.block_id for b in kv.pool.free_queue] == [3, 4, 5, 2, 1, 0]


def test_a_freed_request_has_its_tail_block_evicted_before_its_head_block():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    req = make_request("a", list(range(12)))  # 3 full blocks, all cached
    prefill(kv, req)
    kv.free(req)

    evicted = kv.pool.get_new_blocks(1)

    assert [b.block_id for b in evicted] == [2]
    again = make_request("b", list(range(12)))
    assert [b.block_id for b in kv.get_computed_blocks(again)[0]] == [0, 1]


def test_evicting_the_lru_cached_block_removes_its_hash_from_the_cache():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5])  # blocks 0 (full, cached as hash_a) and 1
    prefill(kv, a)
    hash_a = a.block_hashes[0]
    kv.free(a)  # free queue: 2, 1, 0
    b = make_request("b", [6, 7, 8, 9, 10])  # takes blocks 2 (cached as hash_b) and 1
    prefill(kv, b)
    hash_b = b.block_hashes[0]
    kv.free(b)  # free queue: 0, 1, 2 -- block 0 is now the least recently used
    assert kv.get_block_ids("b") == []

    c = make_request("c", [11, 12])
    prefill(kv, c)

    assert kv.get_block_ids("c") == [0]
    assert kv.pool.blocks[0].block_hash is None
    assert hash_a not in kv.pool.cached
    assert kv.pool.cached[hash_b] is kv.pool.blocks[2]
    assert kv.get_computed_blocks(make_request("a2", [1, 2, 3, 4, 5])) == ([], 0)
    assert kv.get_computed_blocks(make_request("b2", [6, 7, 8, 9, 10])) == ([kv.pool.blocks[2]], BS)


def test_reviving_a_cached_free_block_takes_it_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))  # blocks 0, 1 full and cached, block 2 partial
    prefill(kv, a)
    kv.free(a)

    b = make_request("b", list(range(9)))
    hits = prefill(kv, b)

    assert [blk.block_id for blk in hits] == [0, 1]
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    assert kv.get_block_ids("b") == [0, 1, 3]  # free queue was 3, 2, 1, 0; the hits left it, 3 was popped
    assert [blk.block_id for blk in kv.pool.free_queue] == [2]


# ---- prefix caching --------------------------------------------------------------------------------------


def test_the_last_prompt_token_is_never_served_from_the_cache():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(100, 100 + 3 * BS))  # exactly 3 full blocks
    prefill(kv, make_request("a", prompt))
    assert len(kv.pool.cached) == 3

    hits, num_hit_tokens = kv.get_computed_blocks(make_request("b", prompt))

    assert (len(hits), num_hit_tokens) == (2, 2 * BS)


def test_a_prompt_one_token_past_three_full_blocks_hits_all_three():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(100, 100 + 3 * BS))
    prefill(kv, make_request("a", prompt))

    hits, num_hit_tokens = kv.get_computed_blocks(make_request("b", prompt + [7]))

    assert (len(hits), num_hit_tokens) == (3, 3 * BS)


def test_a_prefix_hit_stops_at_the_first_differing_block():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prefill(kv, make_request("a", list(range(3 * BS + 1))))
    other = list(range(3 * BS + 1))
    other[BS + 1] = 999  # second block differs, so the third's chained hash differs too

    hits, num_hit_tokens = kv.get_computed_blocks(make_request("b", other))

    assert ([b.block_id for b in hits], num_hit_tokens) == ([0], BS)


def test_without_prefix_caching_nothing_is_hashed_or_hit():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    prefill(kv, make_request("a", list(range(9))))

    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert kv.pool.cached == {}
    assert all(b.block_hash is None for b in kv.pool.blocks)


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    prefill(kv, make_request("a", list(range(5))))  # 2 blocks
    before = [(b.ref_cnt, b.block_hash) for b in kv.pool.blocks]

    big = make_request("big", list(range(50, 50 + 2 * BS)))
    assert kv.allocate_slots(big, big.num_tokens) is None

    assert [(b.ref_cnt, b.block_hash) for b in kv.pool.blocks] == before
    assert kv.num_free_blocks() == 1
    assert "big" not in kv.req_to_blocks


def test_reset_prefix_cache_refuses_while_blocks_are_in_use_and_clears_when_idle():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    prefill(kv, a)

    assert kv.pool.reset_prefix_cache() is False
    kv.free(a)
    assert kv.pool.reset_prefix_cache() is True
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


# ---- property test ---------------------------------------------------------------------------------------

# Prompts are drawn as a prefix of one of a few base sequences plus a random tail, so prefix hits are common.
_BASES = [[(7 * b + 3 * i) % 23 for i in range(4 * BS)] for b in range(3)]
_token = st.integers(min_value=0, max_value=22)


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions, prefill chunks, decodes, frees and preemptions against one small pool."""

    NUM_BLOCKS = 12
    ENABLE_CACHING = True
    MAX_CACHED_FREE = None  # --cache-size-gb's cap, in blocks

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BS, self.ENABLE_CACHING,
                                 max_cached_free_blocks=self.MAX_CACHED_FREE)
        self.running: dict[str, Request] = {}  # holds blocks
        self.preempted: dict[str, Request] = {}  # holds none; resumes through the prefix cache
        self.ids = itertools.count()

    # -- helpers --
    def _snapshot(self):
        pool = self.kv.pool
        return ([(b.ref_cnt, b.block_hash) for b in pool.blocks], [b.block_id for b in pool.free_queue],
                dict(pool.cached), {k: list(v) for k, v in self.kv.req_to_blocks.items()})

    def _admit(self, req: Request, chunk: int) -> bool:
        """Schedule a request that holds no blocks: prefix hits, then up to `chunk` new tokens."""
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        assert num_hit_tokens == len(hits) * BS and num_hit_tokens < req.num_tokens
        num_new = min(chunk, req.num_tokens - num_hit_tokens)
        before = self._snapshot()
        if self.kv.allocate_slots(req, num_new, hits) is None:
            assert self._snapshot() == before, "a failed allocation changed the pool"
            return False
        req.num_computed_tokens = num_hit_tokens + num_new
        self._sample_if_prefilled(req)
        return True

    @staticmethod
    def _sample_if_prefilled(req: Request) -> None:
        # A step that reaches the last known token samples one more, as the engine does.
        if req.num_computed_tokens == req.num_tokens:
            req.append_token((req.num_tokens * 5) % 23)

    # -- rules --
    @rule(base=st.integers(0, len(_BASES) - 1), prefix_len=st.integers(0, 4 * BS),
          tail=st.lists(_token, max_size=2 * BS), chunk=st.integers(1, 6 * BS))
    def add_request(self, base, prefix_len, tail, chunk):
        prompt = _BASES[base][:prefix_len] + tail
        if not prompt:
            prompt = [0]
        req = make_request(f"r{next(self.ids)}", prompt)
        if self._admit(req, chunk):
            self.running[req.request_id] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 6 * BS))
    def step(self, data, chunk):
        """A prefill chunk or, once the prompt is computed, a decode of the token sampled last step."""
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert num_new >= 1
        before = self._snapshot()
        within_room = req.num_computed_tokens + num_new <= self.kv.room.get(req.request_id, -1)
        if within_room:  # the scheduler skips allocate_slots here: it must have nothing to do
            cached = dict(self.kv.num_cached_blocks)
            assert self.kv.allocate_slots(req, num_new) == [] and self._snapshot() == before
            assert self.kv.num_cached_blocks == cached
        elif self.kv.allocate_slots(req, num_new) is None:
            assert self._snapshot() == before, "a failed allocation changed the pool"
            return
        req.num_computed_tokens += num_new
        self._sample_if_prefilled(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kv.free(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.preempted[req.request_id] = req

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), chunk=st.integers(1, 6 * BS))
    def resume(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.preempted)))
        if self._admit(self.preempted[rid], chunk):
            self.running[rid] = self.preempted.pop(rid)

    # -- invariants --
    @invariant()
    def ref_counts_equal_table_membership(self):
        tables = self.kv.req_to_blocks
        assert set(tables) == set(self.running), "only running requests hold block tables"
        owners = Counter(b.block_id for table in tables.values() for b in table)
        for table in tables.values():
            assert len({b.block_id for b in table}) == len(table), "a block appears twice in one table"
        for b in self.kv.pool.blocks:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == owners[b.block_id], f"block {b.block_id}"

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self):
        pool = self.kv.pool
        queued = [b.block_id for b in pool.free_queue]
        assert len(queued) == len(set(queued)) == pool.num_free_blocks() == self.kv.num_free_blocks()
        assert set(queued) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}

    @invariant()
    def hash_map_points_only_at_blocks_with_that_hash(self):
        for h, block in self.kv.pool.cached.items():
            assert block.block_hash == h
        if not self.ENABLE_CACHING:
            assert self.kv.pool.cached == {}

    @invariant()
    def free_cached_blocks_stay_within_the_cap(self):
        pool = self.kv.pool
        if self.MAX_CACHED_FREE is None:
            assert pool.cached_free == {}
            return
        free_hashed = {b.block_id for b in pool.free_queue if b.block_hash is not None}
        assert set(pool.cached_free) == free_hashed and len(free_hashed) <= self.MAX_CACHED_FREE

    @invariant()
    def the_persistent_block_table_rows_equal_the_block_lists(self):
        # what a step gathers (KVCacheManager.block_table) is each request's list of block ids, whatever was
        # appended, preempted, freed and re-admitted before; a row per holder, none left for a freed request
        tables = self.kv.tables
        assert set(tables.row_of) == set(self.kv.req_to_blocks)
        assert len(set(tables.row_of.values())) == len(tables.row_of)
        for rid, blocks in self.kv.req_to_blocks.items():
            row = tables.row_of[rid]
            assert tables.ids[row, :tables.lens[row]].tolist() == [b.block_id for b in blocks]
        if self.running:
            reqs = [self.running[r] for r in sorted(self.running)]
            got = self.kv.block_table(reqs)
            for i, req in enumerate(reqs):
                ids = self.kv.get_block_ids(req.request_id)
                assert got[i, :len(ids)].tolist() == ids

    @invariant()
    def tables_cover_exactly_the_computed_tokens(self):
        for rid, req in self.running.items():
            assert len(self.kv.req_to_blocks[rid]) == -(-req.num_computed_tokens // BS)

    @invariant()
    def hashed_blocks_hold_their_requests_tokens(self):
        # A block a request reads through the cache must carry the chained hash of that request's tokens.
        for rid, req in self.running.items():
            expected = chain_hashes(req.all_token_ids)
            for i, block in enumerate(self.kv.req_to_blocks[rid]):
                if block.block_hash is not None:
                    assert (i + 1) * BS <= req.num_computed_tokens, "a not-yet-computed block is cached"
                    assert block.block_hash == expected[i]

    def teardown(self):
        for req in self.running.values():
            self.kv.free(req)
        self.running.clear()
        self.ref_counts_equal_table_membership()
        self.free_queue_holds_exactly_the_unreferenced_blocks()
        assert self.kv.num_free_blocks() == self.NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


class KVCacheMachineNoCaching(KVCacheMachine):
    ENABLE_CACHING = False


class KVCacheMachineCappedCache(KVCacheMachine):
    MAX_CACHED_FREE = 2


_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheManagerInvariants = KVCacheMachine.TestCase
TestKVCacheManagerInvariants.settings = _SETTINGS
TestKVCacheManagerInvariantsWithoutCaching = KVCacheMachineNoCaching.TestCase
TestKVCacheManagerInvariantsWithoutCaching.settings = _SETTINGS
TestKVCacheManagerInvariantsWithCappedCache = KVCacheMachineCappedCache.TestCase
TestKVCacheManagerInvariantsWithCappedCache.settings = _SETTINGS


def test_block_pool_counts_usage_from_free_blocks():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    pool.get_new_blocks(3)

    assert pool.num_free_blocks() == 1
    assert pool.usage() == 0.75


# ---- block hashes: SHA-256, stable across processes, salted per tenant ---------------------------------------


def test_block_hash_is_sha256_of_parent_tokens_and_extra_keys():
    tokens = [5, 70000, 2**31 + 7, 0]
    root = hashlib.sha256(b"vserve prefix cache v1").digest()
    first = hash_block_tokens(None, tokens)
    assert first == hashlib.sha256(root + struct.pack("<5I", 4, *tokens)).digest()
    salted = hash_block_tokens(None, tokens, ("tenant-a",))
    assert salted == hashlib.sha256(root + struct.pack("<5I", 4, *tokens) + b'["tenant-a"]').digest()
    assert hash_block_tokens(first, tokens) == hashlib.sha256(first + struct.pack("<5I", 4, *tokens)).digest()
    assert len({first, salted, hash_block_tokens(None, tokens, ("tenant-b",)), hash_block_tokens(first, tokens),
                hash_block_tokens(None, tokens[:3])}) == 5


def test_block_hash_is_the_same_in_another_process_whatever_its_hash_seed():
    code = ("from vserve.core.kv_cache import hash_block_tokens as h; "
            "print(h(h(None, [1, 2, 3]), [4, 5, 6], ('salt',)).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {hash_block_tokens(hash_block_tokens(None, [1, 2, 3]), [4, 5, 6], ("salt",)).hex()}


def test_requests_with_different_cache_salts_never_share_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(3 * BS + 1))
    a = make_request("a", prompt, cache_salt="tenant-a")
    prefill(kv, a)
    for rid, salt in (("b", "tenant-b"), ("none", None)):
        other = make_request(rid, prompt, cache_salt=salt)
        assert prefill(kv, other) == []
        assert not set(kv.get_block_ids(rid)) & set(kv.get_block_ids("a"))
        assert not set(other.block_hashes) & set(a.block_hashes)
    same = make_request("a2", prompt, cache_salt="tenant-a")
    assert [b.block_id for b in prefill(kv, same)] == kv.get_block_ids("a")[:3]


def test_block_tables_grow_past_their_first_rows_and_columns_and_reuse_freed_rows():
    from vserve.core.kv_cache import BlockTables, KVCacheBlock

    t = BlockTables(rows=2, cols=2)
    lists = {f"r{i}": [KVCacheBlock(1000 * i + j) for j in range(i % 7 + 1)] for i in range(9)}
    for rid, blocks in lists.items():  # appended a block at a time, as decode steps do
        for j in range(len(blocks)):
            t.write(rid, j, blocks[j:j + 1])
    got = t.gather(lists)
    for i, blocks in enumerate(lists.values()):
        assert got[i, :len(blocks)].tolist() == [b.block_id for b in blocks]
    assert got.shape == (9, 7) and t.ids.shape[0] >= 9
    row = t.row_of["r3"]
    t.drop("r3")
    t.write("new", 0, [KVCacheBlock(5)])
    assert t.row_of["new"] == row and "r3" not in t.row_of  # the freed row is taken again
    got = t.gather(["new", "r8"])
    assert got[0, 0] == 5 and t.lens[row] == 1 and got[1].tolist() == [8000, 8001]  # r8: 8 % 7 + 1 blocks
