"""W8A8 inputs quantized per token by the kernel that produces them (RMSNorm, fused add + RMSNorm, SiLU-and-mul;
Triton under its interpreter on CPU): the same codes and scales, bit for bit, as producing the activation and then
quantizing it."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported


import pytest  # noqa: E402
import torch  # noqa: E402

from vserve.kernels import ops_ref, triton_ops  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # interpreter

FP8, INT8 = torch.float8_e4m3fn, torch.int8
# bf16 only against the unfused kernels: the interpreter's float -> bf16 conversion is not torch's, in both alike
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MIN_SCALE = torch.tensor(ops_ref.MIN_SCALE, dtype=torch.float32)  # an all-zero row's scale


def _codes(q: torch.Tensor) -> torch.Tensor:
    """Codes as integers: fp8 by its bit pattern (neighbouring values of one sign differ by 1)."""
    return (q.view(torch.uint8) if q.dtype == FP8 else q).to(torch.int16)


def _assert_same(got: tuple, expected: tuple, seed: int) -> None:
    (q, s), (rq, rs) = got, expected
    assert q.dtype == rq.dtype and s.dtype == torch.float32 and s.shape == rs.shape, (q.dtype, s.shape, seed)
    assert torch.equal(s, rs) and torch.equal(_codes(q), _codes(rq)), f"torch.manual_seed({seed})"


def _assert_near_reference(got: tuple, expected: tuple, dtype: torch.dtype, seed: int) -> None:
    """The Triton norm and SiLU round a value to the other side of a tie now and then (fp32 sums in another order,
    another exp): a scale within the dtype's rounding, codes at most one step apart."""
    if dtype == torch.bfloat16:
        return
    (q, s), (rq, rs) = got, expected
    rtol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(s, rs, rtol=rtol, atol=0, msg=lambda m: f"{m}\n(torch.manual_seed({seed}))")
    assert int((_codes(q) - _codes(rq)).abs().max()) <= 1, f"torch.manual_seed({seed})"


def _rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows of width n, one of them all zeros (the scale's floor) and one with a large outlier."""
    x = torch.randn(7, n) * torch.rand(7, 1) * 4
    x[2] = 0.0
    x[4, n // 3] = 300.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", [FP8, INT8])
def test_rms_norm_quant_gives_the_unfused_kernels_codes_and_scales(seed, dtype, qdtype):
    n = 300  # not a power of two: a masked tail
    x, w = _rows(n, dtype), (1 + 0.1 * torch.randn(n)).to(dtype)
    got = triton_ops.rms_norm_quant(x, w, 1e-6, qdtype)
    _assert_same(got, triton_ops.per_token_quant(triton_ops.rms_norm(x, w, 1e-6), qdtype), seed)
    _assert_near_reference(got, ops_ref.rms_norm_quant_ref(x, w, 1e-6, qdtype), dtype, seed)
    assert int(_codes(got[0])[2].abs().max()) == 0 and got[1][2] == MIN_SCALE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", [FP8, INT8])
def test_fused_add_rms_norm_quant_gives_the_unfused_kernels_codes_scales_and_residual(seed, dtype, qdtype):
    n = 300
    x, w = _rows(n, dtype), (1 + 0.1 * torch.randn(n)).to(dtype)
    res = torch.randn(7, n).to(dtype)
    res[2] = 0.0
    got, new_res = triton_ops.fused_add_rms_norm_quant(x, res, w, 1e-5, qdtype)
    normed, expected_res = triton_ops.fused_add_rms_norm(x, res, w, 1e-5)
    _assert_same(got, triton_ops.per_token_quant(normed, qdtype), seed)
    assert torch.equal(new_res, expected_res), seed
    ref, ref_res = ops_ref.fused_add_rms_norm_quant_ref(x, res, w, 1e-5, qdtype)
    _assert_near_reference(got, ref, dtype, seed)
    if dtype != torch.bfloat16:
        assert torch.equal(new_res, ref_res), seed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", [FP8, INT8])
@pytest.mark.parametrize("block", [16384, 128])  # the row computed once, and twice in three chunks (max, codes)
def test_silu_and_mul_quant_gives_the_unfused_kernels_codes_and_scales(seed, dtype, qdtype, block):
    x = torch.cat([_rows(300, dtype), _rows(300, dtype).flip(-1)], -1)  # [gate | up], outliers apart (fp16's range)
    got = triton_ops.silu_and_mul_quant(x, qdtype, block=block)
    assert got[0].shape == (7, 300) and got[1].shape == (7, 1)
    _assert_same(got, triton_ops.per_token_quant(triton_ops.silu_and_mul(x), qdtype), seed)
    _assert_near_reference(got, ops_ref.silu_and_mul_quant_ref(x, qdtype), dtype, seed)
    assert int(_codes(got[0])[2].abs().max()) == 0 and got[1][2] == MIN_SCALE


@pytest.mark.parametrize("qdtype", [FP8, INT8])
def test_fused_references_are_the_unfused_references(seed, qdtype):
    x, res, w = torch.randn(4, 96, dtype=torch.bfloat16), torch.randn(4, 96, dtype=torch.bfloat16), torch.rand(96)
    w = w.to(torch.bfloat16)
    _assert_same(ops_ref.rms_norm_quant_ref(x, w, 1e-6, qdtype),
                 ops_ref.per_token_quant_ref(ops_ref.rms_norm_ref(x, w, 1e-6), qdtype), seed)
    got, h = ops_ref.fused_add_rms_norm_quant_ref(x, res, w, 1e-6, qdtype)
    normed, h_ref = ops_ref.fused_add_rms_norm_ref(x, res, w, 1e-6)
    _assert_same(got, ops_ref.per_token_quant_ref(normed, qdtype), seed)
    assert torch.equal(h, h_ref)
    g = torch.randn(4, 192, dtype=torch.bfloat16)
    _assert_same(ops_ref.silu_and_mul_quant_ref(g, qdtype),
                 ops_ref.per_token_quant_ref(ops_ref.silu_and_mul_ref(g), qdtype), seed)
