"""The batched LoRA kernels (Triton under its interpreter on CPU) equal their torch references, and the references
equal a plain per-row x·Aᵀ·Bᵀ: several ranks, packed slices of unequal widths, rows grouped unevenly over the slots,
rows without adapter left untouched."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vserve.kernels import lora_ref, triton_lora  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # interpreter

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2)}
CASES = [  # rank (stored R), slices' widths, K, row counts per slot (-1 first: rows without adapter)
    (16, (48,), 40, {-1: 3, 0: 5, 2: 1}),
    (32, (32, 16, 16), 64, {-1: 0, 0: 1, 1: 19, 2: 2}),  # packed q/k/v, one slot with more than a row block
    (64, (24, 24), 300, {-1: 7, 1: 4}),  # packed gate/up; K in three splits of 128, 128 and 44
]


def _case(R, widths, K, groups, dtype, S=3):
    slots = torch.tensor([s for s, n in groups.items() for _ in range(n)], dtype=torch.long)
    slots = slots[torch.randperm(len(slots))]  # a slot's rows scattered through the batch
    T, L = len(slots), len(widths)
    x = torch.randn(T, K).to(dtype)
    a = (torch.randn(S, L * R, K) * 0.1).to(dtype)
    b = (torch.randn(S, sum(widths), R) * 0.1).to(dtype)
    bounds = (0, *torch.tensor(widths).cumsum(0).tolist())
    return x, a, b, slots, bounds


def _per_row(x, a, b, slots, bounds, R):
    """The meaning: each row with an adapter gets x·A_jᵀ·B_jᵀ on slice j."""
    out = torch.zeros(x.shape[0], bounds[-1])
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for j in range(len(bounds) - 1):
            h = x[t].float() @ a[s, j * R:(j + 1) * R].float().T
            out[t, bounds[j]:bounds[j + 1]] = h @ b[s, bounds[j]:bounds[j + 1]].float().T
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_shrink_expand_match_reference_and_meaning(case, dtype, seed):
    R, widths, K, groups = CASES[case]
    x, a, b, slots, bounds = _case(R, widths, K, groups, dtype)
    m = lora_ref.lora_mapping(slots, a.shape[0])
    base = torch.randn(x.shape[0], bounds[-1]).to(dtype)
    has = slots >= 0
    msg = f"(torch.manual_seed({seed}))"

    buf_ref = lora_ref.lora_shrink_ref(x, a, m)
    for split_k in (None, 1, 3):  # the heuristic's split, none, and three slices of K (the last one short)
        buf = triton_lora.lora_shrink(x, a, m, split_k)
        torch.testing.assert_close(buf[has], buf_ref[has], **TOL[dtype],
                                   msg=lambda s, k=split_k: f"{s}\nsplit {k} {msg}")

    out_ref, out = base.clone(), base.clone()
    lora_ref.lora_expand_ref(buf_ref, b, out_ref, m, bounds)
    triton_lora.lora_expand(buf_ref, b, out, m, bounds)
    torch.testing.assert_close(out, out_ref, **TOL[dtype], msg=lambda s: f"{s}\n{msg}")
    for split_k in (1, 3):  # the shrink's split-K partials added up by the expand as it reads them
        parts = triton_lora.lora_shrink(x, a, m, split_k, partial=True)
        assert parts.shape[1:] == buf_ref.shape and 1 <= parts.shape[0] <= split_k  # K's blocks of 64 split
        fused = base.clone()
        triton_lora.lora_expand(parts, b, fused, m, bounds)
        torch.testing.assert_close(fused, out_ref, **TOL[dtype], msg=lambda s, k=split_k: f"{s}\nsplit {k} {msg}")
    ref_parts = base.clone()  # the reference takes partials too (its shrink returns one)
    lora_ref.lora_expand_ref(lora_ref.lora_shrink_ref(x, a, m, partial=True), b, ref_parts, m, bounds)
    torch.testing.assert_close(ref_parts, out_ref, **TOL[dtype], msg=lambda s: f"{s}\n{msg}")
    assert torch.equal(out[~has], base[~has]), "rows without adapter must be left untouched"
    expected = base.float() + _per_row(x, a, b, slots, bounds, R)
    torch.testing.assert_close(out_ref.float(), expected, **TOL[dtype], msg=lambda s: f"{s}\n{msg}")


def test_mapping_groups_rows_by_slot():
    slots = torch.tensor([2, -1, 0, 2, 2, -1])
    m = lora_ref.lora_mapping(slots, 3)
    assert m.slot_counts.tolist() == [2, 1, 0, 3]
    assert m.slot_starts.tolist() == [0, 2, 3, 3]
    assert m.token_order.tolist() == [1, 5, 2, 0, 3, 4]


@pytest.mark.parametrize("T,S", [(1, 8), (6, 3), (40, 3), (256, 8), (256, 32), (33, 1)])
def test_mapping_tiles_cover_each_slots_rows_once(T, S, seed):
    """The kernels' row tiles: every row with an adapter in exactly one tile of its own slot, no tile over another
    slot's rows, and the tile count (the grid) a function of T and S alone, whatever the grouping."""
    for trial in range(3):
        slots = torch.randint(-1, S, (T,)) if trial else torch.full((T,), S - 1)
        m = lora_ref.lora_mapping(slots, S)
        assert m.tile_slot.shape == m.tile_row.shape == (lora_ref.num_tiles(T, S),)
        covered = []
        for s, r in zip(m.tile_slot.tolist(), m.tile_row.tolist()):
            if s == S:
                continue
            assert 0 <= s < S and r % lora_ref.TILE_M == 0 and r < m.slot_counts[s + 1]
            start, count = m.slot_starts[s + 1].item(), m.slot_counts[s + 1].item()
            rows = m.token_order[start + r:start + min(r + lora_ref.TILE_M, count)]
            assert (slots[rows] == s).all(), f"tile of slot {s} over other rows (torch.manual_seed({seed}))"
            covered += rows.tolist()
        assert sorted(covered) == sorted(torch.nonzero(slots >= 0).flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_check_lora_rows_pass_under_the_interpreter(dtype):
    """kernels/gpu_check.py's LoRA rows (what the H200 check runs in bf16/fp16 on the 8B shapes), on a tiny shape."""
    from vserve.kernels import gpu_check

    rows = gpu_check.check_lora("tiny-gqa4", gpu_check.TINY_MODELS["tiny-gqa4"], dtype, "cpu", tiny=True)
    assert len(rows) == 16 and all(r.ok for r in rows), [r.cells() for r in rows if not r.ok]


def test_gpu_check_lora_bench_runs_under_the_interpreter():
    from vserve.kernels import gpu_check

    rows = gpu_check.bench_lora("tiny-gqa4", gpu_check.TINY_MODELS["tiny-gqa4"], torch.float32, "cpu", tiny=True)
    assert len(rows) == 8 and all(r.ms is not None for r in rows), [r.cells() for r in rows]
