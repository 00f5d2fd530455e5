"""Attention kernels for the families beyond Llama match their torch references under the Triton interpreter:
per-layer sliding windows (blocks before a query's window are never read), tanh logit softcapping (Gemma 2) and
head_dim 256 (Gemma), in decode and in prefill; and the window the references apply is HF's."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vserve.kernels import triton_attention  # noqa: E402
from vserve.kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _cache(ctx_lens, bs, kvh, d, dtype):
    """Random caches, each sequence's blocks scattered over the pool; block 0 is all NaN (padding entries of the
    table point at other sequences' blocks: the references gather them, masked)."""
    nblocks = [-(-n // bs) for n in ctx_lens]
    num_blocks = sum(nblocks) + 1
    k_cache = torch.randn(num_blocks, bs, kvh, d, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(num_blocks, bs, kvh, d, dtype=dtype, device=DEVICE)
    k_cache[0] = v_cache[0] = float("nan")
    perm = 1 + torch.randperm(num_blocks - 1, device=DEVICE)
    bt = torch.randint(1, num_blocks, (len(ctx_lens), max(nblocks) + 1), dtype=torch.int32, device=DEVICE)
    used = 0
    for b, nb in enumerate(nblocks):
        bt[b, :nb] = perm[used:used + nb].int()
        used += nb
    return k_cache, v_cache, bt, torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)


def _freed(bt, first_pos, bs, window):
    """The table as the KV manager leaves it: blocks wholly before each row's first query's window -> block 0
    (NaN), which the kernels must not read."""
    bt = bt.clone()
    for b, p in enumerate(first_pos):
        bt[b, :max(0, p - window + 1) // bs] = 0
    return bt


def _close(out, ref, dtype, seed):
    assert torch.isfinite(out).all(), f"(torch.manual_seed({seed}))"
    torch.testing.assert_close(out, ref.to(out.dtype), **TOL[dtype], msg=lambda m: f"{m}\n(torch.manual_seed({seed}))")


def _f32(*ts):
    return [t.float() for t in ts]


# (block size, kv heads, group, head dim, dtype, window, softcap, partition size or None)
DECODE_CASES = [
    (16, 2, 2, 64, torch.float32, 24, None, 32),  # windows that skip whole partitions
    (16, 1, 4, 64, torch.float16, 40, 50.0, None),
    (16, 2, 2, 256, torch.float32, None, 30.0, None),  # Gemma's head dim, softcap only
    (32, 1, 2, 256, torch.float16, 7, 50.0, 64),  # window inside one block
]


@pytest.mark.parametrize("bs,kvh,group,d,dtype,window,softcap,partition", DECODE_CASES)
def test_decode_window_and_softcap_match_reference(seed, bs, kvh, group, d, dtype, window, softcap, partition):
    ctx = [3, 30, int(torch.randint(90, 200, ()))]
    k_cache, v_cache, bt, ctx_lens = _cache(ctx, bs, kvh, d, dtype)
    q = torch.randn(len(ctx), kvh * group, d, dtype=dtype, device=DEVICE)
    scale = d ** -0.5
    ref = paged_decode_attention_ref(*_f32(q, k_cache, v_cache), bt, ctx_lens, scale, window, softcap)
    freed = bt if window is None else _freed(bt, [n - 1 for n in ctx], bs, window)
    kw = {} if partition is None else dict(partition_size=partition, block_n=16)
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, freed, ctx_lens, scale, window, softcap, **kw)
    _close(out, ref, dtype, seed)


# (block size, kv heads, group, head dim, dtype, window, softcap, (block_m, block_n))
PREFILL_CASES = [
    (16, 2, 1, 64, torch.float32, 24, None, (32, 16)),
    (16, 1, 2, 64, torch.float16, 17, 50.0, (32, 32)),
    (16, 1, 2, 256, torch.float32, None, 50.0, (16, 16)),
    (32, 2, 2, 256, torch.float16, 40, None, (32, 16)),
]


@pytest.mark.parametrize("bs,kvh,group,d,dtype,window,softcap,blocks", PREFILL_CASES)
def test_prefill_window_and_softcap_match_reference(seed, bs, kvh, group, d, dtype, window, softcap, blocks):
    # (context_len, chunk length): whole prompts longer than the window and chunks after a cached prefix
    r = int(torch.randint(0, 20, ()))
    seqs = [(70 + r, 70 + r), (100 + r, 9), (5, 5), (90, 33 + r)]
    ctx = [c for c, _ in seqs]
    k_cache, v_cache, bt, ctx_lens = _cache(ctx, bs, kvh, d, dtype)
    cu = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32,
                      device=DEVICE)
    q = torch.randn(int(cu[-1]), kvh * group, d, dtype=dtype, device=DEVICE)
    scale = d ** -0.5
    ref = paged_prefill_attention_ref(*_f32(q, k_cache, v_cache), cu, ctx_lens, bt, scale, window, softcap)
    freed = bt if window is None else _freed(bt, [c - n for c, n in seqs], bs, window)
    out = triton_attention.paged_prefill_attention(q, k_cache, v_cache, cu, ctx_lens, freed, scale, window, softcap,
                                                   block_m=blocks[0], block_n=blocks[1])
    _close(out, ref, dtype, seed)


def test_reference_window_and_softcap_are_hf_eager_attention(seed):
    """The references' window (p - window < j <= p) and softcap are those of HF's eager attention with its
    sliding-window causal mask (transformers' masking_utils), on one whole prompt."""
    from transformers.masking_utils import sliding_window_overlay

    n, H, d, window, cap = 40, 2, 16, 9, 5.0
    k_cache, v_cache, bt, ctx_lens = _cache([n], 8, H, d, torch.float32)
    q = torch.randn(n, H, d, device=DEVICE)
    cu = torch.tensor([0, n], device=DEVICE)
    out = paged_prefill_attention_ref(q, k_cache, v_cache, cu, ctx_lens, bt, 0.25, window, cap)
    k = k_cache[bt[0, :5].long()].flatten(0, 1)[:n].transpose(0, 1)
    v = v_cache[bt[0, :5].long()].flatten(0, 1)[:n].transpose(0, 1)
    s = torch.tanh(q.transpose(0, 1) @ k.transpose(1, 2) * 0.25 / cap) * cap
    i = torch.arange(n)
    keep = torch.tensor([[bool(sliding_window_overlay(window)(0, 0, a, b)) and b <= a for b in i] for a in i])
    expected = (s.masked_fill(~keep, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    dec = paged_decode_attention_ref(q[-1:], k_cache, v_cache, bt, ctx_lens, 0.25, window, cap)
    torch.testing.assert_close(dec, expected[-1:], atol=1e-5, rtol=1e-5)
