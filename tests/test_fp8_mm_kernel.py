"""The Triton split-K FP8 GEMM (kernels/triton_fp8_mm.py) matches fp8_mm_ref, its oracle, on fresh random data
(under the Triton interpreter on CPU): one split and several, rows that do not fill a tile, each output dtype;
the split partials are summed in order (two calls give equal bits) and the arrival counts are left at 0."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vserve.kernels import ops_ref, scaled_mm, triton_fp8_mm, triton_ops  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAUNCH = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def _operands(M: int, N: int, K: int):
    x = torch.randn(M, K, device=DEVICE) * 3
    xq, xs = ops_ref.per_token_quant_ref(x, torch.float8_e4m3fn)
    wq, ws = ops_ref.per_token_quant_ref(torch.randn(N, K, device=DEVICE) * 0.05, torch.float8_e4m3fn)
    return xq, xs, wq, ws


@pytest.mark.parametrize("M,N,K,split", [(1, 32, 128, 1), (5, 64, 256, 2), (33, 96, 512, 4), (17, 40, 192, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("swap", [False, True])
def test_fp8_mm_splitk_matches_reference(seed, M, N, K, split, dtype, swap):
    """swap: each tile computed transposed (the weight rows on the dot's wide side)."""
    xq, xs, wq, ws = _operands(M, N, K)
    ref = scaled_mm.fp8_mm_ref(xq, xs, wq, ws, dtype)
    got = triton_fp8_mm.fp8_mm_splitk(xq, xs, wq, ws, dtype, split_k=split, swap=swap, **LAUNCH)
    assert got.dtype == dtype and got.shape == (M, N)
    # the same fp32 products; only the order of the fp32 sums differs (splits, tiles of the dot)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * float(ref.abs().max()), rtol=tol,
                               msg=lambda m: f"{m}\n(torch.manual_seed({seed}))")
    if split > 1:
        assert torch.equal(got, triton_fp8_mm.fp8_mm_splitk(xq, xs, wq, ws, dtype, split_k=split, swap=swap,
                                                             **LAUNCH))
        assert int(triton_ops.arrival_counts(xq.device, 1).abs().sum()) == 0


def test_fp8_mm_splitk_rejects_a_k_the_splits_do_not_divide():
    xq, xs, wq, ws = _operands(4, 32, 96)
    with pytest.raises(AssertionError):
        triton_fp8_mm.fp8_mm_splitk(xq, xs, wq, ws, torch.float32, split_k=2, **LAUNCH)


def test_fp8_splitk_table_lookup_and_launches():
    entries = ((32, dict(split_k=2)), (96, None), (128, dict(split_k=1)))
    got = [scaled_mm.table_launch(entries, m) for m in (1, 32, 33, 96, 97, 128, 129)]
    assert got == [dict(split_k=2), dict(split_k=2), None, None, dict(split_k=1), dict(split_k=1), None]
    for (K, _N), rows in scaled_mm.FP8_SPLITK.items():  # every tuned launch is one fp8_mm_splitk can run at K
        assert [m for m, _ in rows] == sorted({m for m, _ in rows})
        for _, cfg in rows:
            assert cfg is None or (K % (cfg["split_k"] * cfg["block_k"]) == 0
                                   and set(cfg) <= {"block_m", "block_n", "block_k", "split_k", "num_warps",
                                                    "num_stages", "swap"})
    assert scaled_mm.fp8_splitk_launch(16, 4096, 4096, torch.device("cpu")) is None  # sm_90 only
