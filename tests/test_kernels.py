"""Triton kernels match their pure-torch references (run under the Triton interpreter on CPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vserve.kernels import ops_ref, triton_attention, triton_ops  # noqa: E402
from vserve.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kvcache_ref,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's tl.dot is wrong for bf16, so bf16 is checked on GPUs only (kernels/gpu_check.py)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, seed: int, **kw) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), **TOL[dtype], **kw,
                               msg=lambda m: f"{m}\n(torch.manual_seed({seed}))")


def _poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _paged_cache(ctx_lens: list[int], bs: int, kvh: int, d: int, dtype: torch.dtype):
    """Random caches with each sequence's blocks scattered over the pool; padding entries in the block table
    point at other sequences' blocks (the kernels must ignore them)."""
    nblocks = [-(-n // bs) for n in ctx_lens]
    width = max(nblocks) + 1
    num_blocks = sum(nblocks) + 2
    k_cache = torch.randn(num_blocks, bs, kvh, d, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(num_blocks, bs, kvh, d, dtype=dtype, device=DEVICE)
    perm = torch.randperm(num_blocks, device=DEVICE)
    block_tables = torch.randint(0, num_blocks, (len(ctx_lens), width), dtype=torch.int32, device=DEVICE)
    used = 0
    for b, nb in enumerate(nblocks):
        block_tables[b, :nb] = perm[used:used + nb].int()
        used += nb
    return k_cache, v_cache, block_tables, torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)


def _f32(*ts):
    return [t.float() for t in ts]


# ---------------------------------------------------------------------------------------------------- store


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,kvh,d", [(16, 2, 64), (64, 3, 80)])
def test_store_kvcache_writes_slots_and_skips_padding(seed, dtype, bs, kvh, d):
    T, num_blocks = 37, 4
    slots = torch.randperm(num_blocks * bs, device=DEVICE)[:T]
    slots[torch.rand(T, device=DEVICE) < 0.3] = -1
    slots[0] = -1
    # k/v as views of a packed qkv projection: the token stride is not kvh * d
    qkv = torch.randn(T, 2 * kvh + 2, d, dtype=dtype, device=DEVICE)
    k, v = qkv[:, 2:2 + kvh], qkv[:, 2 + kvh:]
    k_cache, v_cache = _poisoned((num_blocks, bs, kvh, d), dtype), _poisoned((num_blocks, bs, kvh, d), dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    triton_attention.store_kvcache(k, v, k_cache, v_cache, slots)
    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, atol=0, rtol=0, msg=lambda m: f"{m}\nseed={seed}")
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, atol=0, rtol=0, msg=lambda m: f"{m}\nseed={seed}")
    assert int(k_cache.flatten(0, 1).isnan().all(-1).all(-1).sum()) == num_blocks * bs - int((slots >= 0).sum())


def test_store_kvcache_into_an_fp8_cache_rounds_as_the_reference(seed):
    """--kv-cache-dtype fp8: every value on the e4m3 grid exactly as torch rounds it (ties, tiny and huge
    values: saturated at +-448 where torch's own cast gives NaN); padding slots stay untouched."""
    T, bs, kvh, d, num_blocks = 40, 16, 2, 64, 4
    slots = torch.randperm(num_blocks * bs, device=DEVICE)[:T]
    slots[::5] = -1
    k = torch.randn(T, kvh, d, device=DEVICE, dtype=torch.float16) * 30
    v = torch.randn(T, kvh, d, device=DEVICE, dtype=torch.float16)
    k[1, 0, :4] = torch.tensor([1000.0, -600.0, 1.9375, 2.0**-12])
    k_cache = torch.zeros(num_blocks, bs, kvh, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    triton_attention.store_kvcache(k, v, k_cache, v_cache, slots)
    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), seed
    assert k_ref.flatten(0, 1)[slots[1], 0, :4].float().tolist() == [448.0, -448.0, 2.0, 0.0]
    assert not k_ref.float().isnan().any()


def _fp8_cache(*caches):
    return [c.clamp(-448, 448).to(torch.float8_e4m3fn) for c in caches]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_over_an_fp8_cache_matches_reference(seed, dtype):
    """Decode and prefill read an fp8 e4m3 cache, upcast to the queries' dtype, as the references do."""
    bs, kvh, group, d = 16, 2, 4, 80  # head dim 80: padded lanes are masked, not read as fp8 garbage
    ctx = [1, 17, int(torch.randint(100, 301, ()))]
    k_cache, v_cache, bt, ctx_lens = _paged_cache(ctx, bs, kvh, d, torch.float32)
    k8, v8 = _fp8_cache(k_cache * 4, v_cache)
    q = torch.randn(len(ctx), kvh * group, d, dtype=dtype, device=DEVICE)
    out = triton_attention.paged_decode_attention(q, k8, v8, bt, ctx_lens, d**-0.5, partition_size=128,
                                                  out=_poisoned(q.shape, dtype))
    _close(out, paged_decode_attention_ref(q.float(), k8, v8, bt, ctx_lens, d**-0.5), dtype, seed)
    seqs = [(37, 37), (200, 5), (130, 64)]
    k_cache, v_cache, bt, ctx_lens = _paged_cache([c for c, _ in seqs], bs, kvh, d, torch.float32)
    k8, v8 = _fp8_cache(k_cache, v_cache)
    cu = torch.tensor([0, 37, 42, 106], dtype=torch.int32, device=DEVICE)
    q = torch.randn(106, kvh * group, d, dtype=dtype, device=DEVICE)
    out = triton_attention.paged_prefill_attention(q, k8, v8, cu, ctx_lens, bt, d**-0.5, block_m=32, block_n=32,
                                                   out=_poisoned(q.shape, dtype))
    _close(out, paged_prefill_attention_ref(q.float(), k8, v8, cu, ctx_lens, bt, d**-0.5), dtype, seed)


# ---------------------------------------------------------------------------------------------------- decode

DECODE_CASES = [  # block size, kv heads, group size, head dim, dtype, partition size (None: the default)
    (16, 2, 1, 64, torch.float32, 128),
    (16, 2, 4, 64, torch.float16, None),
    (16, 1, 3, 64, torch.float16, 64),
    (64, 2, 4, 64, torch.float32, 128),
    (64, 1, 3, 64, torch.float16, None),
    (64, 2, 4, 96, torch.float32, 128),
    (32, 1, 4, 80, torch.float16, 128),
    (256, 1, 4, 64, torch.float16, 256),
    (16, 2, 4, 128, torch.float16, 1024),
]


@pytest.mark.parametrize("bs,kvh,group,d,dtype,partition", DECODE_CASES)
def test_decode_attention_matches_reference(seed, bs, kvh, group, d, dtype, partition):
    ctx = [1, 17, int(torch.randint(100, 301, ()))]  # never all multiples of the block size
    ctx[2] += ctx[2] % bs == 0
    k_cache, v_cache, bt, ctx_lens = _paged_cache(ctx, bs, kvh, d, dtype)
    H = kvh * group
    q = torch.randn(len(ctx), H, d, dtype=dtype, device=DEVICE)
    scale = d**-0.5
    kw = {} if partition is None else dict(partition_size=partition)
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, bt, ctx_lens, scale,
                                                  out=_poisoned(q.shape, dtype), **kw)
    ref = paged_decode_attention_ref(*_f32(q, k_cache, v_cache), bt, ctx_lens, scale)
    _close(out, ref, dtype, seed)


@pytest.mark.parametrize("fused_reduce", [True, False])
def test_decode_attention_small_kv_tiles_and_many_partitions(seed, fused_reduce):
    """Up to 8 partitions a sequence, combined by the last partition to finish (fused_reduce) or by the reduce
    kernel; the fused path leaves its arrival counts at 0 for the next launch."""
    k_cache, v_cache, bt, ctx_lens = _paged_cache([5, 250, 33], 16, 2, 64, torch.float32)
    q = torch.randn(3, 4, 64, device=DEVICE)
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, bt, ctx_lens, 0.125, partition_size=32,
                                                  block_n=16, fused_reduce=fused_reduce,
                                                  out=_poisoned(q.shape, torch.float32))
    _close(out, paged_decode_attention_ref(q, k_cache, v_cache, bt, ctx_lens, 0.125), torch.float32, seed)
    if fused_reduce:
        assert int(triton_ops.arrival_counts(q.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("chunk", [1, 2, 4])
@pytest.mark.parametrize("fused_reduce", [True, False])
def test_decode_partials_combined_a_chunk_at_a_time(seed, chunk, fused_reduce):
    """The partials are combined combine_chunk partitions per round of loads, rescaled to the running max: 7
    partitions (a masked chunk tail at 2 and 4), and under a window of 20 tokens a row whose first chunks hold only
    empty partitions (m = -inf: weighed 0, never NaN)."""
    k_cache, v_cache, bt, ctx_lens = _paged_cache([9, 200, 130], 16, 2, 64, torch.float32)
    q = torch.randn(3, 6, 64, device=DEVICE)
    for window in (None, 20):
        out = triton_attention.paged_decode_attention(q, k_cache, v_cache, bt, ctx_lens, 0.125, window,
                                                      partition_size=32, block_n=16, fused_reduce=fused_reduce,
                                                      combine_chunk=chunk, out=_poisoned(q.shape, torch.float32))
        _close(out, paged_decode_attention_ref(q, k_cache, v_cache, bt, ctx_lens, 0.125, window), torch.float32,
               seed)
    if fused_reduce:
        assert int(triton_ops.arrival_counts(q.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("partition,width,fused", [(64, None, True), (1024, None, True), (16, 8, True),
                                                   (16, 8, False)])
def test_decode_row_with_empty_context_gives_zeros(seed, partition, width, fused):
    """CUDA-graph padding rows have context_len 0: they must come out finite (zeros), not NaN, also when the
    table is as wide as the graphs capture it (several partitions a row: width blocks)."""
    k_cache, v_cache, bt, _ = _paged_cache([40, 40], 16, 1, 64, torch.float32)
    if width is not None:
        bt = torch.cat([bt, bt.new_zeros(2, width - bt.shape[1])], dim=1)
    ctx_lens = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 2, 64, device=DEVICE)
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, bt, ctx_lens, 0.125,
                                                  partition_size=partition, block_n=16, fused_reduce=fused,
                                                  out=_poisoned(q.shape, torch.float32))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    _close(out[:1], paged_decode_attention_ref(q[:1], k_cache, v_cache, bt[:1], ctx_lens[:1], 0.125),
           torch.float32, seed)


# ---------------------------------------------------------------------------------------------------- prefill

PREFILL_CASES = [  # block size, kv heads, group size, head dim, dtype, (block_m, block_n) or None for the default
    (16, 2, 1, 64, torch.float32, (32, 32)),
    (16, 1, 4, 64, torch.float16, None),
    (64, 2, 3, 64, torch.float16, (32, 16)),
    (64, 1, 4, 64, torch.float32, (64, 32)),
    (16, 1, 3, 96, torch.float16, (32, 32)),
    (256, 1, 2, 64, torch.float16, (32, 64)),
]


@pytest.mark.parametrize("bs,kvh,group,d,dtype,blocks", PREFILL_CASES)
def test_prefill_attention_matches_reference(seed, bs, kvh, group, d, dtype, blocks):
    # (context_len, qlen): whole prompts (context_len == qlen) and chunks after a cached prefix, mixed lengths
    r = int(torch.randint(0, 40, ()))
    seqs = [(37 + r, 37 + r), (200 + r, 5), (1, 1), (130, 64 + r), (65 + r, 1), (20, 20)]
    ctx = [c for c, _ in seqs]
    k_cache, v_cache, bt, ctx_lens = _paged_cache(ctx, bs, kvh, d, dtype)
    cu = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32,
                      device=DEVICE)
    H = kvh * group
    q = torch.randn(int(cu[-1]), H, d, dtype=dtype, device=DEVICE)
    scale = d**-0.5
    kw = {} if blocks is None else dict(block_m=blocks[0], block_n=blocks[1])
    out = triton_attention.paged_prefill_attention(q, k_cache, v_cache, cu, ctx_lens, bt, scale,
                                                   out=_poisoned(q.shape, dtype), **kw)
    ref = paged_prefill_attention_ref(*_f32(q, k_cache, v_cache), cu, ctx_lens, bt, scale)
    _close(out, ref, dtype, seed)


def test_prefill_chunks_agree_with_the_whole_prompt(seed):
    """Chunked prefill (each chunk over the cache the earlier chunks wrote) gives the whole prompt's output."""
    bs, kvh, d, n = 16, 2, 64, 90
    k_cache, v_cache, bt, _ = _paged_cache([n], bs, kvh, d, torch.float32)
    q = torch.randn(n, 4, d, device=DEVICE)
    whole = triton_attention.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, n], device=DEVICE),
                                                     torch.tensor([n], device=DEVICE), bt, 0.125, block_m=32,
                                                     block_n=32)
    parts = [triton_attention.paged_prefill_attention(q[s:e], k_cache, v_cache,
                                                      torch.tensor([0, e - s], device=DEVICE),
                                                      torch.tensor([e], device=DEVICE), bt, 0.125, block_m=32,
                                                      block_n=32)
             for s, e in [(0, 33), (33, 34), (34, 90)]]
    _close(torch.cat(parts), whole, torch.float32, seed)


# ---------------------------------------------------------------------------------------------------- other ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm_and_fused_add_match_reference(seed, dtype, hidden):
    small = torch.tensor([1.0, 2e-3], device=DEVICE).repeat(4)[:7, None]  # rows where eps matters
    x = (torch.randn(7, hidden, device=DEVICE) * small).to(dtype)
    res = (torch.randn(7, hidden, device=DEVICE) * small).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    x0, res0 = x.clone(), res.clone()
    _close(triton_ops.rms_norm(x, w, 1e-6), ops_ref.rms_norm_ref(x, w, 1e-6), dtype, seed)
    normed, new_res = triton_ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_res = ops_ref.fused_add_rms_norm_ref(x, res, w, 1e-5)
    _close(new_res, ref_res, dtype, seed)
    _close(normed, ref_normed, dtype, seed)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # out of place


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(seed, dtype):
    x = torch.randn(3, 5, 2 * 200, dtype=dtype, device=DEVICE)
    out = triton_ops.silu_and_mul(x, block=64)
    assert out.shape == (3, 5, 200)
    _close(out, ops_ref.silu_and_mul_ref(x), dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,kvh,d", [(4, 2, 64), (3, 1, 96)])
def test_rotary_embedding_matches_reference(seed, dtype, H, kvh, d):
    from vserve.core.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(d, 512, 10000.0).to(DEVICE)
    T = 9
    qkv = torch.randn(T, H + 2 * kvh, d, dtype=dtype, device=DEVICE)
    q, k = qkv[:, :H], qkv[:, H:H + kvh]  # views with the packed projection's strides
    q0, k0 = q.clone(), k.clone()
    positions = torch.randint(0, 512, (T,), device=DEVICE)
    qo, ko = triton_ops.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    qr, kr = ops_ref.rotary_embedding_ref(positions, q, k, rope.cos, rope.sin)
    _close(qo, qr, dtype, seed)
    _close(ko, kr, dtype, seed)
    qm, km = rope(positions, q, k)  # the model layer agrees with the reference
    _close(qr, qm, dtype, seed)
    _close(kr, km, dtype, seed)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,kvh,d,bs", [(4, 2, 64, 16), (3, 1, 96, 8)])
def test_rope_fused_into_the_kv_store_equals_the_two_kernels(seed, dtype, cache_dtype, H, kvh, d, bs):
    """rope_store_kvcache (the attention layer's RoPE in its KV store's launch) writes bit for bit what
    rotary_embedding then store_kvcache write, returns the same rotated q, skips padding slots, leaves its inputs
    alone, and agrees with its reference (an fp8 cache: on the e4m3 grid as the reference rounds)."""
    from vserve.core.layers.rotary import RotaryEmbedding
    from vserve.kernels.paged_attention import rope_store_kvcache_ref

    rope = RotaryEmbedding(d, 512, 10000.0).to(DEVICE)
    T, num_blocks = 13, 3
    qkv = torch.randn(T, H + 2 * kvh, d, dtype=dtype, device=DEVICE) * (20 if cache_dtype else 1)
    q, k, v = qkv[:, :H], qkv[:, H:H + kvh], qkv[:, H + kvh:]  # views with the packed projection's strides
    qkv0 = qkv.clone()
    positions = torch.randint(0, 512, (T,), device=DEVICE)
    slots = torch.randperm(num_blocks * bs, device=DEVICE)[:T]
    slots[::4] = -1
    cdt = cache_dtype or dtype

    def caches():
        if cdt == torch.float8_e4m3fn:
            return [torch.zeros(num_blocks, bs, kvh, d, dtype=cdt, device=DEVICE) for _ in range(2)]
        return [_poisoned((num_blocks, bs, kvh, d), cdt) for _ in range(2)]

    (kc, vc), (kc2, vc2), (kcr, vcr) = caches(), caches(), caches()
    qo = triton_attention.rope_store_kvcache(positions, q, k, v, rope.cos, rope.sin, kc, vc, slots)
    q2, k2 = triton_ops.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    triton_attention.store_kvcache(k2, v, kc2, vc2, slots)
    qr = rope_store_kvcache_ref(positions, q, k, v, rope.cos, rope.sin, kcr, vcr, slots)
    assert torch.equal(qo, q2), seed
    for got, want in ((kc, kc2), (vc, vc2)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), seed  # NaN padding slots included
    _close(qo, qr, dtype, seed)
    if cdt == torch.float8_e4m3fn:
        for got, want in ((kc, kcr), (vc, vcr)):  # k rounded to its dtype first, as both paths do
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), seed
    else:
        _close(kc, kcr, dtype, seed, equal_nan=True)
        _close(vc, vcr, dtype, seed, equal_nan=True)
        written = int(kc.flatten(0, 1).isnan().all(-1).all(-1).logical_not().sum())  # the poison left elsewhere
        assert written == int((slots >= 0).sum()), seed
    assert torch.equal(qkv, qkv0), seed


@pytest.mark.parametrize("use_triton", [False, True])
def test_attention_layer_with_rope_in_its_store_equals_rotate_then_attend(seed, monkeypatch, use_triton):
    """The attention layer given rope=(positions, cos, sin) returns and caches what rotating q and k first and
    then attending does, for a step of two decodes and a prefill chunk, on the references (the CPU path) and on
    the Triton kernels; only whole-head rotate-half RoPE takes that path (partial and interleaved rotate first)."""
    from vserve import kernels
    from vserve.core.layers import attention as attention_module
    from vserve.core.layers.attention import Attention, AttentionMetadata
    from vserve.core.layers.rotary import RotaryEmbedding

    ops = kernels._triton() if use_triton else kernels._reference()
    monkeypatch.setattr(attention_module, "for_device", lambda t: ops)
    H, kvh, d, bs, dtype = 4, 2, 64, 16, torch.float32
    rope = RotaryEmbedding(d, 512, 10000.0).to(DEVICE)
    assert rope.rotates_whole_heads
    assert not RotaryEmbedding(d, 512, 10000.0, rotary_dim=d // 2).rotates_whole_heads
    assert not RotaryEmbedding(d, 512, 10000.0, interleaved=True).rotates_whole_heads
    ctx = [5, 20, 7]  # two decode rows (one query at ctx - 1) and a 7-token prefill chunk from position 0
    table = torch.tensor([[4, 0], [1, 2], [3, 0]], dtype=torch.int32, device=DEVICE)
    pos = [4, 19, *range(7)]
    rows = [0, 1] + [2] * 7
    positions = torch.tensor(pos, device=DEVICE)
    slots = torch.tensor([int(table[r, p // bs]) * bs + p % bs for r, p in zip(rows, pos)], device=DEVICE)
    md = AttentionMetadata(slot_mapping=slots, block_tables=table, context_lens=torch.tensor(ctx, device=DEVICE),
                           num_decodes=2, cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32, device=DEVICE))
    qkv = torch.randn(len(pos), H + 2 * kvh, d, dtype=dtype, device=DEVICE)
    q, k, v = qkv[:, :H], qkv[:, H:H + kvh], qkv[:, H + kvh:]
    caches = [torch.randn(5, bs, kvh, d, dtype=dtype, device=DEVICE) for _ in range(2)]  # the contexts' history
    layers = [Attention(H, kvh, d, d**-0.5) for _ in range(2)]
    layers[0].k_cache, layers[0].v_cache = caches[0].clone(), caches[1].clone()
    layers[1].k_cache, layers[1].v_cache = caches[0].clone(), caches[1].clone()
    fused = layers[0](q, k, v, md, rope=(positions, rope.cos, rope.sin))
    q2, k2 = ops.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    plain = layers[1](q2, k2, v, md)
    assert torch.equal(fused, plain), seed
    assert torch.equal(layers[0].k_cache, layers[1].k_cache) and torch.equal(layers[0].v_cache, layers[1].v_cache)
    assert not torch.equal(layers[0].k_cache, caches[0]), seed  # this step's k was written


# ---------------------------------------------------------------------------------------------------- gpu_check


def test_gpu_check_parses_arguments_and_formats_markdown():
    from vserve.kernels import gpu_check

    args = gpu_check.parse_args(["--out", "report.md", "--skip-bench"])
    assert args.out == "report.md" and args.skip_bench and not args.sweep
    rows = [gpu_check.CheckRow("decode", "llama3-8b bs=16", "bfloat16", 1.2e-3, True, "1e-02", 3e-3),
            gpu_check.CheckRow("decode", "x|y", "float16", float("nan"), True)]
    lines = gpu_check.format_table(gpu_check.CHECK_HEADER, [r.cells() for r in rows]).splitlines()
    assert lines[0] == "| kernel | case | dtype | max abs err | torch err | tol | result |"
    assert lines[1] == "| --- | --- | --- | --- | --- | --- | --- |"
    assert lines[2] == "| decode | llama3-8b bs=16 | bfloat16 | 1.20e-03 | 3.00e-03 | 1e-02 | PASS |"
    assert lines[3] == "| decode | x\\|y | float16 | nan | - | - | FAIL |"  # a NaN never passes
    bench = gpu_check.BenchRow("decode", "c", "triton", 2.0, 2135.0, "GB/s")
    assert bench.cells()[3:6] == ["2.000", "2135.0 GB/s", "50% of 4.27 TB/s"]


def test_gpu_check_refuses_to_run_without_cuda(capsys):
    from vserve.kernels import gpu_check

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_check.main(["--skip-bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
