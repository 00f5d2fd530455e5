"""The quantized GEMMs match their references (Triton under its interpreter on CPU): the W4A16/W8A16 kernel on
every checkpoint layout, decode-sized and tiled, the per-token activation quantization, the W8A8 emulation; and
each quantized Linear, whole and split over TP ranks, equals dequantize-then-F.linear."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from vserve.core import distributed  # noqa: E402
from vserve.core.layers.linear import Linear  # noqa: E402
from vserve.core.layers.quantization import QuantConfig, from_hf  # noqa: E402
from vserve.kernels import ops_ref, scaled_mm, triton_ops, triton_w4a16, w4a16_ref  # noqa: E402
from vserve.quantize.formats import pack_awq, pack_gptq, pack_int32  # noqa: E402
from vserve.quantize.rtn import quantize_rtn  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # interpreter: no bf16 dot
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-3),
       torch.bfloat16: dict(atol=6e-2, rtol=1.6e-2)}


def _close(actual, expected, dtype, seed, **kw):
    torch.testing.assert_close(actual, expected.to(actual.dtype), **{**TOL[dtype], **kw},
                               msg=lambda m: f"{m}\n(torch.manual_seed({seed}))")


def quantized_weight(layout: str, N: int, K: int, group: int, act_order: bool = False) -> tuple:
    """Random checkpoint tensors of one [N, K] weight: (qweight, scales, qzeros, g_idx, bits, group_size)."""
    w = torch.randn(N, K) * 0.05
    if layout == "awq":
        qweight, qzeros, s16 = pack_awq(*quantize_rtn(w, 4, group))
        return qweight, s16, qzeros, None, 4, group
    if layout.startswith("gptq"):
        bits = int(layout[4:])
        q, zeros, scales = quantize_rtn(w, bits, group)
        g_idx = torch.arange(K, dtype=torch.int32) // group
        if act_order:
            g_idx = g_idx[torch.randperm(K)]
            q = torch.randint(0, 2**bits, (N, K), dtype=torch.int32)  # any codes: each column reads its g_idx group
        qweight, qzeros, s16, g = pack_gptq(q, zeros, scales, g_idx, bits)
        return qweight, s16, qzeros, g if act_order else None, bits, group
    if layout.startswith("pack"):
        bits = int(layout[4:])
        codes = torch.randint(0, 2**bits, (N, K), dtype=torch.int32)
        scales = torch.rand(N, K // group) * 0.01 + 1e-3
        return pack_int32(codes, bits), scales, None, None, bits, group
    dtype = {"channel_int8": torch.int8, "channel_fp8": torch.float8_e4m3fn}[layout]
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8) if dtype == torch.int8 else \
        (torch.randn(N, K) * 100).clamp(-448, 448).to(dtype)
    return q, torch.rand(N, 1) * 1e-3, None, None, 8, K


CASES = [  # layout, N, K, group, act-order
    ("awq", 192, 256, 64, False),
    ("gptq4", 128, 256, 32, False),
    ("gptq4", 128, 256, 64, True),
    ("gptq8", 96, 128, 128, True),
    ("pack4", 80, 256, 128, False),
    ("pack8", 64, 192, 192, False),  # one group over all inputs: per channel
    ("channel_int8", 64, 128, 128, False),
    ("channel_fp8", 48, 128, 128, False),
]


def _on_device(t):
    return t.to(DEVICE) if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("layout,N,K,group,act_order", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,dequant_m", [(1, None), (7, None), (80, 1 << 30), (40, None)])
def test_w4a16_gemm_matches_reference(seed, layout, N, K, group, act_order, dtype, M, dequant_m):
    """M = 1 and 7: the 16-row decode tile with split-K (AWQ in fp16: its GEMV at 1 row; at 7 rows, and at 80, the
    tile kernel's exact path, x times the exact q - z and then the scales); 80 (dequantize + cuBLAS put off): two
    64-row tiles of the tiled path; 40 (>= DEQUANT_M): the weight dequantized into the shared buffer, then
    torch.matmul."""
    qweight, scales, qzeros, g_idx, bits, gs = map(_on_device, quantized_weight(layout, N, K, group, act_order))
    kind = layout.split("_")[0].rstrip("48")
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    got = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, g_idx, kind, bits, gs, out=out, dequant_m=dequant_m)
    assert got is out
    ref = w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, g_idx, kind, bits, gs)
    _close(got, ref, dtype, seed)


def test_dequantize_path_shares_one_buffer_across_layers(seed):
    """Rows >= DEQUANT_M: each layer's weight is dequantized into one buffer per device and dtype (what CUDA graphs
    capture), grown to the largest weight; a smaller layer after a larger one reuses it, results unchanged."""
    small = [_on_device(t) for t in quantized_weight("awq", 64, 256, 64)]
    large = [_on_device(t) for t in quantized_weight("gptq4", 128, 512, 128)]
    x_small = torch.randn(40, 256, device=DEVICE, dtype=torch.float16)
    x_large = torch.randn(40, 512, device=DEVICE, dtype=torch.float16)
    M = triton_w4a16.DEQUANT_M

    def run(w, x, layout):
        qweight, scales, qzeros, g_idx, bits, gs = w
        got = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, g_idx, layout, bits, gs, dequant_m=M)
        _close(got, w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, g_idx, layout, bits, gs), torch.float16,
               seed)

    run(large, x_large, "gptq")
    buf = triton_w4a16.dequant_buffer(x_large.device, torch.float16, 128 * 512)
    run(small, x_small, "awq")
    run(large, x_large, "gptq")
    again = triton_w4a16.dequant_buffer(x_large.device, torch.float16, 64 * 256)
    assert again.data_ptr() == buf.data_ptr() and buf.numel() >= 128 * 512


@pytest.mark.parametrize("layout,N,K,group,act_order", CASES[:5])
@pytest.mark.parametrize("split_k", [1, 2])
def test_the_one_row_gemv_tile_matches_reference(seed, layout, N, K, group, act_order, split_k):
    """block_m = 1: the GEMV kernel (batch-1 decode), scale and zero applied once per group and column."""
    qweight, scales, qzeros, g_idx, bits, gs = map(_on_device, quantized_weight(layout, N, K, group, act_order))
    kind = layout.split("_")[0].rstrip("48")
    x = torch.randn(1, K, device=DEVICE).to(torch.float16)
    got = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, g_idx, kind, bits, gs, block_m=1, block_n=32,
                                  split_k=split_k)
    _close(got, w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, g_idx, kind, bits, gs), torch.float16, seed)


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_split_k_and_the_dequantize_path_agree_with_the_reference(seed, split_k):
    qweight, scales, qzeros, g_idx, bits, gs = map(_on_device, quantized_weight("awq", 64, 384, 32))
    x = torch.randn(2, 384, device=DEVICE, dtype=torch.float16)
    ref = w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, None, "awq", 4, 32)
    got = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, 32, split_k=split_k, block_k=64,
                                  block_m=16)  # the tile kernel (AWQ's GEMV would take these rows by default)
    _close(got, ref, torch.float16, seed)
    # the split partials summed by the last program of each output tile (above) or by a second kernel
    assert int(triton_ops.arrival_counts(x.device, 1).abs().sum()) == 0
    two_kernels = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, 32, split_k=split_k,
                                          block_k=64, block_m=16, fixup=False)
    _close(two_kernels, ref, torch.float16, seed)
    again = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, 32, split_k=split_k, block_k=64,
                                    block_m=16)
    assert torch.equal(got, again), seed
    whole = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, 32, dequant_m=1)  # cuBLAS path
    _close(whole, ref, torch.float16, seed)
    w = triton_w4a16.w4a16_dequantize(qweight, scales, qzeros, None, "awq", 4, 32, torch.float32)
    assert torch.equal(w, w4a16_ref.dequantize_weight(qweight, scales, qzeros, None, "awq", 4, 32))



@pytest.mark.parametrize("N,K,group,launch", [
    (192, 256, 64, dict(split_k=1)),  # one split: written straight to the output
    (192, 256, 64, dict(split_k=2)),  # whole groups per split, summed by the last program
    (200, 384, 32, dict(split_k=3, block_n=256, num_warps=4)),  # N/8 = 25 words of 32: masked column tail
    (128, 256, 128, dict(split_k=8, block_k=4, num_warps=4)),  # splits inside a group (32 rows each)
])
def test_awq_gemv_splits_and_its_in_kernel_sum(seed, N, K, group, launch):
    """The AWQ batch-1 GEMV (_awq_gemv_kernel; here the interpreter's emulation of its fp16-pair PTX): each launch
    shape matches the reference, with the K-split partials summed in the kernel's last program (in split order: the
    same bits on every call, every arrival count back at 0) and by a second kernel."""
    qweight, scales, qzeros, _, _, gs = map(_on_device, quantized_weight("awq", N, K, group))
    x = torch.randn(1, K, device=DEVICE, dtype=torch.float16)
    ref = w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, None, "awq", 4, gs)
    got = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, gs, **launch)
    _close(got, ref, torch.float16, seed)
    two_kernels = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, gs, fixup=False, **launch)
    _close(two_kernels, ref, torch.float16, seed)
    assert int(triton_ops.arrival_counts(x.device, 1).abs().sum()) == 0
    again = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, gs, **launch)
    assert torch.equal(got, again)


@pytest.mark.parametrize("M,N,K,group,launch", [
    (2, 192, 256, 64, dict(split_k=2)),  # two rows in one launch, partials summed by the last program
    (3, 200, 384, 32, dict(split_k=3, block_n=256, num_warps=4)),  # 3 of 4 rows: masked row and column tails
    (8, 128, 256, 128, dict(split_k=1)),  # a full launch of AWQ_GEMV_ROWS rows, written straight to the output
    (11, 128, 256, 64, dict(split_k=2)),  # more than AWQ_GEMV_ROWS: launches of 6 and 5 rows
])
def test_awq_gemv_takes_a_few_rows_at_once(seed, M, N, K, group, launch):
    """Decode batches of up to gemv_m rows go through the AWQ GEMV, which decodes each word of codes once for all
    the rows of a launch: each row as the reference, the same bits as that row alone, with the partials summed by
    the kernel's last program (every arrival count back at 0; in split order) or by a second kernel."""
    launch = dict(launch, gemv_m=16)
    qweight, scales, qzeros, _, _, gs = map(_on_device, quantized_weight("awq", N, K, group))
    x = torch.randn(M, K, device=DEVICE, dtype=torch.float16)
    mag = torch.ones(M, 1, device=DEVICE)
    mag[1] = 100  # rows of other magnitudes: each has its own power-of-two scale
    x = x * mag.half()
    ref = w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, None, "awq", 4, gs)
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device=DEVICE)
    got = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, gs, out=out, **launch)
    _close(got.float() / mag, ref / mag, torch.float16, seed)
    assert int(triton_ops.arrival_counts(x.device, 1).abs().sum()) == 0
    two_kernels = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, gs, fixup=False, **launch)
    _close(two_kernels.float() / mag, ref / mag, torch.float16, seed)
    alone = triton_w4a16.w4a16_gemm(x[M - 1:], qweight, scales, qzeros, None, "awq", 4, gs, **launch)
    assert torch.equal(alone[0], got[M - 1]), seed


def test_awq_gemv_is_as_precise_as_a_gemm_on_the_dequantized_weight(seed):
    """The AWQ GEMV adds x (q - z) in fp16 pairs, 16 rows at a time, before the scales and the rest of the sum in
    fp32. With every code and zero from 0 to 15 and a few activations 1000x the others (LLMs' massive
    activations), its fp16 outputs are no further from the exact sums than those of a GEMM on the weight
    dequantized to bf16 (fp32 accumulation), and within 4x of one on the weight dequantized to fp16 (max and RMS
    error)."""
    N, K, group = 128, 2048, 128
    q = torch.randint(0, 16, (N, K), dtype=torch.int32)
    zeros = torch.randint(0, 16, (N, K // group), dtype=torch.int32)
    qweight, qzeros, s16 = map(_on_device, pack_awq(q, zeros, torch.rand(N, K // group) * 0.01 + 1e-3))
    x = torch.randn(1, K)
    x[0, ::97] *= 1000
    x = x.to(DEVICE, torch.float16)
    w = w4a16_ref.dequantize_weight(qweight, s16, qzeros, None, "awq", 4, group).double()
    exact = x.double() @ w.t()

    def errors(y):
        e = (y.double() - exact).abs()
        return float(e.max()), float(e.pow(2).mean().sqrt())

    got = errors(triton_w4a16.w4a16_gemm(x, qweight, s16, qzeros, None, "awq", 4, group))
    bf16 = errors((x.float() @ w.to(torch.bfloat16).float().t()).half())
    fp16 = errors((x.float() @ w.half().float().t()).half())
    assert got[0] <= bf16[0] and got[1] <= bf16[1], (got, bf16, seed)
    assert got[0] <= 4 * fp16[0] and got[1] <= 4 * fp16[1], (got, fp16, seed)


@pytest.mark.parametrize("mags", [(1e30,), (1e-30,), (1e30, 1e-30, 1.0)])
def test_awq_gemv_scales_bf16_activations_into_fp16_range(seed, mags):
    """bf16 activations far outside fp16's range (1e30, 1e-30; in one launch, rows of both and an ordinary one) are
    scaled, each row by its own power of two, before the fp16 arithmetic: finite outputs, as close to the exact
    ones as at ordinary magnitudes."""
    qweight, scales, qzeros, _, _, gs = map(_on_device, quantized_weight("awq", 64, 512, 128))
    x = (torch.randn(len(mags), 512, device=DEVICE) * torch.tensor(mags, device=DEVICE)[:, None]).to(torch.bfloat16)
    # gemv_m=8: every row count here through the GEMV
    got = triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "awq", 4, gs, gemv_m=8).double()
    exact = x.double() @ w4a16_ref.dequantize_weight(qweight, scales, qzeros, None, "awq", 4, gs).double().t()
    assert bool(torch.isfinite(got).all()), seed
    rel = (got - exact).norm(dim=1) / exact.norm(dim=1)
    assert float(rel.max()) < 1e-2, (rel, seed)


def test_ptx_kernels_fall_back_to_plain_triton_under_the_interpreter_and_on_rocm(monkeypatch):
    """The AWQ GEMV's fp16-pair PTX (and the attention's fp8 conversion) only where Triton compiles for NVIDIA: a
    ROCm build of torch or the interpreter gets the plain-Triton emulation that CI tests."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_ops._ptx()
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")
    assert not triton_ops._ptx()
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_ops._ptx()


def test_groups_smaller_than_a_tile_are_gathered_per_row(seed):
    """group 8 < the smallest K-tile (16): the wrapper falls back to a per-row group index."""
    qweight, scales, qzeros, _, bits, gs = map(_on_device, quantized_weight("gptq4", 32, 64, 8))
    x = torch.randn(3, 64, device=DEVICE)
    ref = w4a16_ref.w4a16_gemm_ref(x, qweight, scales, qzeros, None, "gptq", 4, 8)
    _close(triton_w4a16.w4a16_gemm(x, qweight, scales, qzeros, None, "gptq", 4, 8), ref, torch.float32, seed)


# ---- W8A8: per-token activation quantization and the GEMM emulation --------------------------------------------


def test_per_token_int8_quant_matches_reference_exactly(seed):
    x = torch.randn(9, 300, device=DEVICE) * torch.rand(9, 1, device=DEVICE) * 10
    x[0] = 0.0  # an all-zero row: the scale floor
    x[1, :3] = torch.tensor([1.0, 0.5, -0.5]) * 127 / 63.5  # exact halves: rounds to even, as torch.round
    q, s = triton_ops.per_token_quant(x, torch.int8, block=128)  # three chunks per row
    rq, rs = ops_ref.per_token_quant_ref(x, torch.int8)
    assert torch.equal(s, rs) and torch.equal(q, rq), seed
    assert q.dtype == torch.int8 and s.shape == (9, 1) and int(q.abs().max()) == 127


@pytest.mark.parametrize("block", [16384, 128])  # the row read once, and in three chunks (two passes)
def test_per_token_fp8_quant_matches_reference_exactly(seed, block):
    """Under the interpreter the kernel rounds to the e4m3 grid itself (round_to_e4m3), on a GPU the hardware
    conversion does; either way exact: ties to even, carries into the exponent (1.9375 -> 2.0), subnormals and
    saturation at 448."""
    x = torch.randn(9, 300, device=DEVICE, dtype=torch.bfloat16)
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every value 0 .. 448
    ties = (grid[:-1] + grid[1:]) / 2  # exactly between two neighbours (bf16 holds them exactly)
    x[0, :252] = torch.cat([ties, -ties]).to(x.dtype)
    x[0, 252:256] = torch.tensor([448.0, 447.0, 2.0**-10, 1.9375])  # row scale 1: the values are quantized as is
    q, s = triton_ops.per_token_quant(x, torch.float8_e4m3fn, block=block)
    rq, rs = ops_ref.per_token_quant_ref(x, torch.float8_e4m3fn)
    assert torch.equal(s, rs) and torch.equal(q.float(), rq.float()), seed


def test_int8_emulation_is_the_int32_gemm():
    """int8_linear_ref sums the integer products exactly, as torch._int_mm's int32 accumulator does."""
    x = torch.randn(20, 256) * 3
    w = torch.randint(-128, 128, (48, 256), dtype=torch.int8)
    ws = torch.rand(48, 1) * 0.01
    xq, xs = ops_ref.per_token_quant_ref(x, torch.int8)
    expected = (torch._int_mm(xq, w.t()).float() * xs * ws.reshape(1, -1))
    assert torch.equal(scaled_mm.int8_linear_ref(x, w, ws), expected)
    close = F.linear(xq.float() * xs, w.float() * ws)  # and it is the fake-quantized product
    torch.testing.assert_close(scaled_mm.int8_linear_ref(x, w, ws), close, atol=1e-4, rtol=1e-4)


def test_fp8_emulation_scales_the_fp8_product(seed):
    x = torch.randn(5, 128, dtype=torch.float16)
    w = (torch.randn(32, 128) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(32, 1) * 0.01
    xq, xs = ops_ref.per_token_quant_ref(x, torch.float8_e4m3fn)
    assert (xq.float().abs().amax(-1) == 448).all()  # each row's largest value lands on the fp8 maximum
    expected = F.linear(xq.float() * xs, w.float() * ws)
    _close(scaled_mm.fp8_linear_ref(x, w, ws), expected, torch.float16, seed)


# ---- quantized Linear layers: packed shards and TP splits --------------------------------------------------------

GROUP = 32
METHODS = {  # name -> quantization_config
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"},
    "gptq4": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False},
    "gptq8-act-order": {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": True},
    "pack4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP,
                                           "symmetric": True}}}},
    "int8-w8a16": {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}},
    "fp8-per-tensor-w8a8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}


def checkpoint_shard(qc: QuantConfig, w: torch.Tensor, g_idx: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Checkpoint tensors of one linear [out, in] in qc's layout and its dequantized weight."""
    if qc.layout == "awq":
        t = dict(zip(("qweight", "qzeros", "scales"), pack_awq(*quantize_rtn(w, 4, GROUP))))
    elif qc.layout == "gptq":
        q, zeros, scales = quantize_rtn(w, qc.bits, GROUP)
        if qc.desc_act:  # codes that read the scales of g_idx's groups
            q = torch.randint(0, 2**qc.bits, w.shape, dtype=torch.int32)
        t = dict(zip(("qweight", "qzeros", "scales", "g_idx"), pack_gptq(q, zeros, scales, g_idx, qc.bits)))
    elif qc.layout == "pack":
        t = dict(weight_packed=pack_int32(torch.randint(0, 16, w.shape), 4), weight_scale=torch.rand(
            w.shape[0], w.shape[1] // GROUP) * 0.01)
    elif qc.kind == "int8":
        t = dict(weight=torch.randint(-128, 128, w.shape, dtype=torch.int8), weight_scale=torch.rand(w.shape[0], 1))
    else:  # one scale per tensor
        t = dict(weight=(w * 4000).clamp(-448, 448).to(torch.float8_e4m3fn), weight_scale=torch.tensor(2.5e-4))
    return t, _dequantize(qc, t, w.shape[1])


def _dequantize(qc: QuantConfig, t: dict, K: int) -> torch.Tensor:
    if qc.layout == "awq":
        return w4a16_ref.dequantize_weight(t["qweight"], t["scales"], t["qzeros"], None, "awq", 4, GROUP)
    if qc.layout == "gptq":
        return w4a16_ref.dequantize_weight(t["qweight"], t["scales"], t["qzeros"], t["g_idx"], "gptq", qc.bits, GROUP)
    if qc.layout == "pack":
        return w4a16_ref.dequantize_weight(t["weight_packed"], t["weight_scale"], None, None, "pack", 4, GROUP)
    return t["weight"].float() * t["weight_scale"].reshape(-1, 1)


def _expected(qc: QuantConfig, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if qc.activations is None:
        return F.linear(x, w)
    xq, xs = ops_ref.per_token_quant_ref(x, torch.float8_e4m3fn if qc.activations == "fp8" else torch.int8)
    return F.linear(xq.float() * xs, w)


def _ranked(tp: int, rank: int):
    return distributed.ParallelState(rank=rank, world_size=tp, tp_size=tp)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_linear_shards_and_tp_splits_equal_dequantize_then_linear(monkeypatch, name, tp):
    """A packed q/k/v layer (column-parallel) and a row-parallel one, each rank built as its process would and
    loaded from the full checkpoint tensors: column ranks hold their rows of every shard; row ranks' partial
    products sum to the whole (W8A8 ranks quantize their own slice of the input)."""
    torch.manual_seed(0)
    qc = from_hf(METHODS[name])
    H, sizes = 128, {"q": 64, "k": 32, "v": 32}
    g_idx = (torch.arange(H, dtype=torch.int32) // GROUP)[torch.randperm(H)] if qc.desc_act else \
        torch.arange(H, dtype=torch.int32) // GROUP
    shards = {sid: checkpoint_shard(qc, torch.randn(n, H) * 0.05, g_idx) for sid, n in sizes.items()}
    down, down_w = checkpoint_shard(qc, torch.randn(64, H) * 0.05, g_idx)
    x = torch.randn(5, H)
    col_parts, row_sum = [], 0
    for rank in range(tp):
        monkeypatch.setattr(distributed, "_STATE", _ranked(tp, rank))
        qkv = Linear(H, sizes, parallel="column", quant_config=qc, prefix="model.layers.0.self_attn.qkv_proj")
        row = Linear(H, 64, parallel="row", quant_config=qc, prefix="model.layers.0.mlp.down_proj")
        params = dict(qkv.named_parameters())
        for sid, (tensors, _) in shards.items():
            for pname, t in tensors.items():
                qkv.weight_loader(params[pname], t, sid)
        for pname, t in down.items():
            row.weight_loader(dict(row.named_parameters())[pname], t)
        col_parts.append(qkv.quant_method.apply(qkv, x, None))
        k = H // tp
        xs = x[:, rank * k:(rank + 1) * k]
        row_sum = row_sum + row.quant_method.apply(row, xs, None)
        if qc.activations is not None:  # W8A8: each rank's dynamic scales come from its own slice
            torch.testing.assert_close(row.quant_method.apply(row, xs, None),
                                       _expected(qc, xs, down_w[:, rank * k:(rank + 1) * k]), atol=1e-4, rtol=1e-4)
    splits = [sizes[s] // tp for s in sizes]
    got = torch.cat([torch.cat([p.split(splits, -1)[i] for p in col_parts], -1) for i in range(3)], -1)
    full = torch.cat([w for _, w in shards.values()])
    torch.testing.assert_close(got, _expected(qc, x, full), atol=1e-4, rtol=1e-4)
    if qc.activations is None:
        torch.testing.assert_close(row_sum, F.linear(x, down_w), atol=1e-4, rtol=1e-4)


def test_packed_shards_must_agree_on_g_idx():
    qc = from_hf(METHODS["gptq8-act-order"])
    layer = Linear(64, {0: 32, 1: 32}, parallel="column", quant_config=qc, prefix="model.layers.0.mlp.gate_up_proj")
    g = torch.arange(64, dtype=torch.int32) // GROUP
    for sid, gi in ((0, g), (1, g.flip(0))):
        t, _ = checkpoint_shard(qc, torch.randn(32, 64), gi)
        if sid == 1:
            with pytest.raises(ValueError, match="shard 1 of a packed layer has a different"):
                layer.weight_loader(layer.g_idx, t["g_idx"], sid)
        else:
            layer.weight_loader(layer.g_idx, t["g_idx"], sid)


def test_ignored_layers_stay_unquantized_and_split_packs_are_refused():
    qc = from_hf({"quant_method": "compressed-tensors", "format": "float-quantized",
                  "ignore": ["lm_head", "re:.*mlp.down_proj$", "model.layers.1.self_attn.k_proj"],
                  "config_groups": {"g": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}})
    assert qc.linear_method("model.layers.0.mlp.down_proj") is None
    assert qc.linear_method("model.layers.0.mlp.gate_up_proj") is not None
    with pytest.raises(ValueError, match="quantizes some of model.layers.1.self_attn.q_proj, "
                                         "model.layers.1.self_attn.k_proj, model.layers.1.self_attn.v_proj but not"):
        qc.linear_method("model.layers.1.self_attn.qkv_proj")


def test_programmatic_dependent_launch_only_on_hopper_nvidia_gpus(monkeypatch):
    """pdl_launch turns the kernels' PDL on (and the launch option) only for CUDA tensors on compute capability
    9.0+, outside the interpreter and ROCm, while triton_ops.PDL is set and VSERVE_DISABLE_PDL is not."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("VSERVE_DISABLE_PDL", raising=False)
    monkeypatch.setattr(triton_ops, "_ptx", lambda: True)
    monkeypatch.setattr(triton_ops, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(triton_ops, "PDL", True)
    assert triton_ops.pdl_launch(cuda) == {"PDL": True, "launch_pdl": True}
    assert triton_ops.pdl_launch(cpu) == {"PDL": False}
    monkeypatch.setattr(triton_ops, "_capability", lambda device: (8, 0))  # an A100
    assert triton_ops.pdl_launch(cuda) == {"PDL": False}
    monkeypatch.setattr(triton_ops, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(triton_ops, "_ptx", lambda: False)  # the interpreter, ROCm
    assert triton_ops.pdl_launch(cuda) == {"PDL": False}
    monkeypatch.setattr(triton_ops, "_ptx", lambda: True)
    monkeypatch.setenv("VSERVE_DISABLE_PDL", "1")
    assert triton_ops.pdl_launch(cuda) == {"PDL": False}
    monkeypatch.setenv("VSERVE_DISABLE_PDL", "0")
    assert triton_ops.pdl_launch(cuda) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(triton_ops, "PDL", False)
    assert triton_ops.pdl_launch(cuda) == {"PDL": False}
