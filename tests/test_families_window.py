"""Sliding-window attention for real: a model whose every layer slides serves past its window (--max-model-len is no
longer capped at it), the KV manager releases the blocks behind the window, and the memory planner counts only
what a sequence then keeps."""

import os
import random

import pytest

from vserve import LLM, SamplingParams
from vserve.core.kv_cache import OUT_OF_WINDOW, KVCacheManager
from vserve.core.memory import GiB, kv_blocks_per_seq, plan_memory
from vserve.core.model_config import ModelConfig
from vserve.ops.model_shapes import KNOWN_SHAPES

WINDOW = 24


def test_planner_counts_the_window_where_every_layer_slides():
    """Mistral shape, window 4,096, --max-model-len 32,768: a sequence holds the window's blocks plus one step's,
    not 32k tokens' worth, so about 2.7x as many sequences fit."""
    m = ModelConfig.from_dict({**KNOWN_SHAPES["mistral-7b"], "sliding_window": 4096})
    assert m.kv_window() == 4096
    kw = dict(gpu_memory_bytes=141 * GiB, max_model_len=32768, max_num_batched_tokens=8192, block_size=16)
    full, windowed = plan_memory(m, **kw), plan_memory(m, sliding_window=m.kv_window(), **kw)
    assert full.kv_blocks_per_seq == 32768 // 16
    assert windowed.kv_blocks_per_seq == 4095 // 16 + 1 + 1 + 8192 // 16  # window (straddling) + one step
    assert windowed.num_blocks == full.num_blocks  # the same cache, shared by more sequences
    assert windowed.max_concurrency == pytest.approx(full.max_concurrency * 2048 / 769)
    assert windowed.max_model_len == 32768 and windowed.max_model_len_fit == 32768
    # a cache too small for one whole sequence still serves it behind the window
    small = dict(kw, num_kv_blocks=1000)
    assert plan_memory(m, **small).verdict == "oom" and plan_memory(m, sliding_window=4096, **small).fits
    assert kv_blocks_per_seq(100, 16, 4096) == 7  # never more than the whole sequence


def test_layers_that_do_not_all_slide_keep_every_block():
    gemma2 = ModelConfig.from_dict({**KNOWN_SHAPES["gemma-2-9b"]})
    assert [gemma2.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert gemma2.kv_window() is None
    gemma3 = ModelConfig.from_dict({**KNOWN_SHAPES["gemma-3-1b"]})
    assert [gemma3.layer_window(i) is None for i in range(6)] == [False] * 5 + [True]
    assert ModelConfig.from_dict({**KNOWN_SHAPES["mistral-7b"]}).kv_window() is None  # Mistral v0.2+: no window


def _release_behind_window(llm: LLM) -> dict:
    """The engine's KV manager, which EngineCore gave ModelConfig.kv_window(): records the most blocks any request
    held at once, at every allocation."""
    kv = llm.llm_engine.core.kv
    assert kv.sliding_window == WINDOW
    peak = {"blocks": 0}
    allocate = kv.allocate_slots

    def recording(req, *args, **kw):
        out = allocate(req, *args, **kw)
        held = [b for b in kv.req_to_blocks.get(req.request_id, []) if b is not OUT_OF_WINDOW]
        peak["blocks"] = max(peak["blocks"], len(held))
        return out

    kv.allocate_slots = recording
    return peak


@pytest.mark.parametrize("caching", [True, False])
def test_decoding_past_the_window_with_blocks_released_matches_hf(tmp_path, default_model_dir, caching):
    """A tiny Mistral with window 24: prompts of up to 90 tokens and 40 new tokens, a 12-block cache that cannot
    hold two whole sequences, chunked prefill; blocks behind the window go back to the pool as requests move on
    (no request ever holds more than window + one step's blocks), and the output is HF's token for token."""
    from test_families import TINY, build_tiny, hf_greedy

    seed = int.from_bytes(os.urandom(4), "little")
    build_tiny(tmp_path, "MistralConfig", dict(sliding_window=WINDOW), seed, default_model_dir)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in (90, 7, 64, 33)]
    expected = hf_greedy(tmp_path, prompts, 40)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=16, enable_prefix_caching=caching,
              num_kv_blocks=12, max_model_len=130, max_num_batched_tokens=16)
    peak = _release_behind_window(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected, f"model seed {seed}"
    assert peak["blocks"] <= kv_blocks_per_seq(130, 16, WINDOW, 16) < -(-130 // 16)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_released_blocks_keep_their_place_in_the_block_table():
    """Released blocks read as block 0 in the table (never read: outside every query's window), are not freed
    twice when the request ends, and all blocks are free when idle."""
    from vserve.core.request import Request

    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, sliding_window=5)
    req = Request(request_id="r", prompt_token_ids=list(range(3, 23)), sampling_params=SamplingParams(),
                  max_tokens=4)
    assert kv.allocate_slots(req, 8) is not None  # tokens 0..7: blocks 0, 1
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 8) is not None  # 8..15: the first query (8) sees 4..8, block 0 goes back
    assert kv.req_to_blocks["r"][0] is OUT_OF_WINDOW and kv.get_block_ids("r") == [0, 1, 2, 3]
    assert kv.block_table([req]).tolist() == [[0, 1, 2, 3]]  # the step's persistent row says the same
    assert kv.num_free_blocks() == 8 - 3
    req.num_computed_tokens = 16
    assert kv.allocate_slots(req, 4) is not None  # 16..19: sees 12.., blocks 0-2 are out
    assert kv.num_released["r"] == 3 and kv.num_free_blocks() == 8 - 2
    assert kv.get_block_ids("r")[3:] == [3, 4]
    assert kv.block_table([req]).tolist() == [kv.get_block_ids("r")] and kv.get_block_ids("r")[:3] == [0, 0, 0]
    kv.free(req)
    assert "r" not in kv.tables.row_of
    assert kv.num_free_blocks() == 8 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
