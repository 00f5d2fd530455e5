"""Mixtral-style MoE: the grouped fused Triton kernel (and the per-row one) match their reference on fresh random data
(fp32/fp16, uneven expert loads, experts without tokens, top-k 1/2/8), the expert sort matches its reference, the
launch-config table is read as documented; greedy tokens match HF, under TP=2 and PP=2."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vserve import LLM, SamplingParams  # noqa: E402
from vserve.kernels.moe_ref import fused_moe_ref, moe_align_block_size_ref  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("T", "H", "inter", "E", "k"), [(5, 48, 40, 4, 2), (3, 32, 96, 3, 1)])
def test_per_row_moe_kernel_matches_reference(dtype, T, H, inter, E, k):
    from vserve.kernels.triton_moe import fused_moe_per_row as fused_moe

    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    x = torch.randn(T, H, dtype=dtype, device=DEVICE)
    w13 = (torch.randn(E, 2 * inter, H, device=DEVICE) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, device=DEVICE) / inter ** 0.5).to(dtype)
    weights, ids = torch.softmax(torch.randn(T, E, device=DEVICE), -1).topk(k, dim=-1)
    got = fused_moe(x, w13, w2, weights / weights.sum(-1, keepdim=True), ids, block_n=16, block_k=16)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights / weights.sum(-1, keepdim=True), ids)
    torch.testing.assert_close(got, want.to(dtype), **TOL[dtype], msg=lambda m: f"{m}\n(seed {seed})")


def _routing(T, E, k, skew, seed):
    """top-k of softmax router scores; skew > 0 piles the tokens onto the low experts (uneven loads), and the
    last expert never wins (an expert without tokens) where E > k."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) - skew * torch.arange(E, dtype=torch.float32)
    if E > k:
        logits[:, -1] = -1e9
    weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize(("block", "E", "k", "T"), [(16, 4, 2, 37), (4, 8, 8, 3), (8, 6, 1, 1), (2, 3, 2, 0)])
def test_moe_align_block_size_matches_reference(block, E, k, T, seed):
    from vserve.kernels.triton_fused_moe import moe_align_block_size

    _, ids = _routing(T, E, k, 0.7, seed)
    got, want = moe_align_block_size(ids, block, E), moe_align_block_size_ref(ids, block, E)
    for g, w, name in zip(got, want, ("sorted_ids", "expert_ids", "num_tokens_post_padded")):
        assert torch.equal(g, w), f"{name} (seed {seed})"
    sorted_ids, expert_ids, num = want
    used = sorted_ids[:int(num)]
    assert sorted(used[used < T * k].tolist()) == list(range(T * k))  # every (token, slot) row exactly once
    assert set(expert_ids[expert_ids >= 0].tolist()) == set(ids.unique().tolist())  # no block for an idle expert


GROUPED_CASES = [  # (T, H, I, E, k, skew): top-k 1/2/8, uneven loads, experts without tokens, ragged H and I
    (33, 48, 40, 4, 2, 1.0),
    (9, 32, 24, 8, 8, 0.0),
    (21, 40, 56, 6, 1, 2.0),
    (2, 64, 32, 5, 2, 0.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("T", "H", "inter", "E", "k", "skew"), GROUPED_CASES)
def test_grouped_fused_moe_kernel_matches_reference(dtype, T, H, inter, E, k, skew, seed):
    from vserve.kernels.triton_fused_moe import fused_moe

    x = torch.randn(T, H, dtype=dtype, device=DEVICE)
    w13 = (torch.randn(E, 2 * inter, H, device=DEVICE) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, device=DEVICE) / inter ** 0.5).to(dtype)
    weights, ids = _routing(T, E, k, skew, seed)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids).to(dtype)
    for cfg in (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1),
                dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)):
        got = fused_moe(x, w13, w2, weights, ids, config=cfg, per_row_max_tokens=0)
        torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m, c=cfg: f"{m}\n{c} (seed {seed})")


def test_fused_moe_takes_the_per_row_path_up_to_the_threshold(seed, monkeypatch):
    from vserve.kernels import triton_fused_moe

    calls = []
    monkeypatch.setattr(triton_fused_moe, "fused_moe_per_row", lambda *a: calls.append(a) or fused_moe_ref(*a))
    x = torch.randn(3, 32, device=DEVICE)
    w13, w2 = torch.randn(4, 48, 32, device=DEVICE) * 0.2, torch.randn(4, 32, 24, device=DEVICE) * 0.2
    weights, ids = _routing(3, 4, 2, 0.0, seed)
    small = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1)
    triton_fused_moe.fused_moe(x, w13, w2, weights, ids, config=small, per_row_max_tokens=2)
    assert not calls
    triton_fused_moe.fused_moe(x, w13, w2, weights, ids, config=small, per_row_max_tokens=3)
    assert len(calls) == 1


def test_launch_config_table_picks_the_shape_then_the_largest_bucket_below():
    from vserve.kernels.triton_fused_moe import get_config, moe_configs

    table = {"per_row_max_tokens": 0, "default": {"1": {"BLOCK_M": 16}, "64": {"BLOCK_M": 64}},
             "shapes": {"E=8,I=14336,H=4096": {"1": {"BLOCK_M": 32}, "256": {"BLOCK_M": 128}}}}
    assert get_config(8, 14336, 4096, 255, table)["BLOCK_M"] == 32
    assert get_config(8, 14336, 4096, 256, table)["BLOCK_M"] == 128
    assert get_config(8, 7168, 4096, 63, table)["BLOCK_M"] == 16
    assert get_config(8, 7168, 4096, 4096, table)["BLOCK_M"] == 64
    shipped = moe_configs()  # the file in the package: every entry a complete launch config
    assert shipped["per_row_max_tokens"] >= 0
    for buckets in [shipped["default"], *shipped["shapes"].values()]:
        for cfg in buckets.values():
            assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"} <= set(cfg)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.2,
                                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-mixtral")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_mixtral_greedy_tokens_match_hf_under_tp2_and_pp2(tiny_mixtral, hf_greedy):

    prompts = [[5, 6, 7, 8], list(range(10, 50))]
    expected = hf_greedy(tiny_mixtral, prompts, 16)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        llm = LLM(str(tiny_mixtral), dtype="float32", device="cpu", skip_tokenizer_init=True,
                  tensor_parallel_size=tp, pipeline_parallel_size=pp)
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == expected, f"tp={tp} pp={pp}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_mla_store_and_decode_match_their_references(dtype, seed):
    """The latent store and the absorbed decode through the paged-attention kernels (kernels/triton_mla.py) against
    kernels/mla_ref.py: random block tables, context lengths from 1 to several partitions, a padding slot (-1)."""
    from vserve.kernels import mla_ref, triton_mla

    B, H, nope, rope, v, r, bs, blocks = 3, 4, 16, 16, 24, 32, 16, 64
    cache = torch.zeros(blocks, bs, 1, r + rope, dtype=dtype, device=DEVICE)
    ref_cache = cache.clone()
    ctx = torch.tensor([1, 37, 300], device=DEVICE)
    bt = torch.randperm(blocks, device=DEVICE)[:3 * 19].view(3, 19)
    slots = torch.randperm(blocks * bs, device=DEVICE)[:40]
    slots[5] = -1
    latent, k_pe = torch.randn(40, r, device=DEVICE).to(dtype), torch.randn(40, rope, device=DEVICE).to(dtype)
    triton_mla.store_latent(latent, k_pe, cache, slots)
    mla_ref.store_latent_ref(latent, k_pe, ref_cache, slots)
    assert torch.equal(cache, ref_cache), f"seed {seed}"
    cache.normal_()  # every row attended to holds data
    cache = cache.to(dtype)
    w_kv = (torch.randn(H, nope + v, r, device=DEVICE) / r ** 0.5).to(dtype)
    q_nope, q_pe = torch.randn(B, H, nope, device=DEVICE).to(dtype), torch.randn(B, H, rope, device=DEVICE).to(dtype)
    got = triton_mla.mla_decode_attention(q_nope, q_pe, cache, bt, ctx, w_kv, 0.2)
    want = mla_ref.mla_decode_attention_ref(q_nope.float(), q_pe.float(), cache.float(), bt, ctx, w_kv.float(), 0.2)
    torch.testing.assert_close(got, want.to(dtype), **TOL[dtype], msg=lambda m: f"{m}\n(seed {seed})")
