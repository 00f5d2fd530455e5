"""The sampling kernel draws the reference's tokens, by the softmax probabilities, and never a zero-mass token (run
under the Triton interpreter on CPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vserve.core import sampler as sampler_module  # noqa: E402
from vserve.core.request import Request  # noqa: E402
from vserve.core.sampling_params import SamplingParams  # noqa: E402
from vserve.kernels import triton_sampling  # noqa: E402
from vserve.kernels.sampling_ref import cdf_boundary_ties, sample_from_logits_ref  # noqa: E402
from vserve.kernels.triton_sampling import (  # noqa: E402
    _chunk_partials_kernel,
    _split_draw_kernel,
    sample_from_logits,
    split_plan,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")
# Where kernel and reference differ, the target must sit on a CDF boundary: every float64 prefix between the two
# tokens within TIE_RTOL of it. The interpreter's tl.cumsum adds fp32 values one after another, so over 5003
# columns its prefix sums drift up to ~1e-5 of the total (9e-6 was the largest in 200 random rows); 1e-4 leaves
# room, and a wrong token is off by the mass of the tokens between, which random rows rarely make that small.
TIE_RTOL = 1e-4


def _check_draws(logits: torch.Tensor, u: torch.Tensor, got: torch.Tensor, seed: int) -> None:
    ref = sample_from_logits_ref(logits, u)
    ties = cdf_boundary_ties(logits, u, got, ref, TIE_RTOL)
    bad = (~ties).nonzero().flatten().tolist()
    assert not bad, f"rows {bad}: kernel {got[bad].tolist()} reference {ref[bad].tolist()} (torch.manual_seed({seed}))"
    drawn = logits.gather(1, got.unsqueeze(1))
    assert bool(drawn.isfinite().all()), f"a masked token drawn (torch.manual_seed({seed}))"


def _random_rows(B: int, V: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i of kind i % 4: plain, 90% masked (one column always kept, as the filters do), one-hot, peaked; u spread
    over [0, 1), near 0, or near 1."""
    logits = torch.randn(B, V, device=DEVICE) * torch.tensor([2.0, 2.0, 1.0, 12.0], device=DEVICE).repeat(B)[:B, None]
    masked = torch.rand(logits[1::4].shape, device=DEVICE) < 0.9
    masked[:, int(torch.randint(0, V, ()))] = False
    logits[1::4] = logits[1::4].masked_fill(masked, NEG_INF)
    logits[2::4] = NEG_INF
    logits[2::4, int(torch.randint(0, V, ()))] = 0.0
    r, kind = torch.rand(B, device=DEVICE), torch.randint(0, 3, (B,), device=DEVICE)
    u = torch.where(kind == 0, r, torch.where(kind == 1, r * 1e-6, (1 - r * 1e-6).clamp(max=1 - 2**-24)))
    u[0] = 0.0
    return logits.to(dtype), u


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,V,block", [(1, 1000, 4096), (6, 1000, 128), (5, 5003, 4096), (6, 5003, 1024),
                                       (3, 7, 4096), (2, 1, 4096)])
def test_kernel_draws_the_reference_token(seed, dtype, B, V, block):
    """Every row, every V (the tail chunk masked), one chunk or many: the reference's token, or a CDF-boundary
    tie; the same uniforms drawn again give the same tokens."""
    logits, u = _random_rows(B, V, dtype)
    got = sample_from_logits(logits, u, block=block)
    assert got.dtype == torch.int64 and got.shape == (B,)
    _check_draws(logits, u, got, seed)
    assert torch.equal(sample_from_logits(logits, u, block=block), got)


def test_reference_draws_follow_the_softmax_probabilities(seed):
    """20000 draws of one row: chi-square against softmax(logits) (masked tokens never drawn). The p-value bound
    1e-6 makes a false failure a one-in-a-million event; expected counts are in the tens at least (randn logits
    over 7 tokens), where the chi-square approximation holds."""
    V, N = 10, 20000
    logits = torch.randn(V, device=DEVICE)
    logits[torch.randperm(V, device=DEVICE)[:3]] = NEG_INF
    probs = logits.double().softmax(-1)
    tokens = sample_from_logits_ref(logits.expand(N, V), torch.rand(N, device=DEVICE))
    counts = torch.bincount(tokens, minlength=V).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = N * probs[kept]
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
    dof = torch.tensor(int(kept.sum()) - 1, dtype=torch.float64)
    p_value = float(torch.special.gammaincc(dof / 2, chi2.cpu() / 2))
    assert p_value > 1e-6, (p_value, counts.tolist(), probs.tolist(), seed)


def test_kernel_maps_evenly_spaced_u_onto_the_softmax_probabilities(seed):
    """The kernel's u -> token map is the inverse CDF: of N evenly spaced u, token i gets N * p_i of them up to
    one (an interval of length N * p_i holds the floor or the ceiling of it), plus one for a rounding at a
    boundary. Rows of stride 0 (one row expanded), two chunks each."""
    V, N = 10, 128
    logits = torch.randn(V, device=DEVICE)
    logits[torch.randperm(V, device=DEVICE)[:3]] = NEG_INF
    u = (torch.arange(N, device=DEVICE) + 0.5) / N
    tokens = sample_from_logits(logits.expand(N, V), u, block=8)
    counts = torch.bincount(tokens, minlength=V).double()
    expected = N * logits.double().softmax(-1)
    assert float((counts - expected).abs().max()) <= 2, (counts.tolist(), expected.tolist(), seed)


DRAWS = [sample_from_logits_ref, lambda x, u: sample_from_logits(x, u, block=64, splits=1),
         lambda x, u: sample_from_logits(x, u, splits=3, split_block=64)]


@pytest.mark.parametrize("draw", DRAWS, ids=["reference", "kernel", "split kernel"])
def test_a_zero_mass_token_is_never_drawn(seed, draw):
    """The zero-mass rule: the last column with mass at or before the crossing. u near 1 gives the first column
    with mass; u = 0 (target = total) and a target above every prefix (what rounding can produce; u < 0 forces it)
    the last one, not the masked tail; a row without mass gives 0 rather than a crash."""
    V = 300
    logits = torch.randn(6, V, device=DEVICE)
    logits[:3, :100] = NEG_INF
    logits[:3, 200:] = NEG_INF
    logits[:3, 100] = 4.0
    logits[3] = NEG_INF
    logits[4] = NEG_INF
    logits[4, 250] = 1.0
    logits[5, 1::2] = NEG_INF  # every odd column masked
    u = torch.tensor([1 - 2**-24, 0.0, -1.0, 0.5, 0.3, 0.0], device=DEVICE)

    tokens = draw(logits, u).tolist()

    assert tokens[:5] == [100, 199, 199, 0, 250], seed
    assert tokens[5] == V - 2, seed


# The split tests run rows in P chunks of C columns, C a multiple of the split block, V not a multiple of C.
SPLIT_CASES = [(5003, 2, 256), (4999, 3, 512), (5000, 4, 256), (3000, 5, 128), (4097, 6, 256)]  # V, P, split block


@pytest.mark.parametrize("draw", DRAWS, ids=["reference", "kernel", "split kernel"])
def test_a_draw_skips_chunks_without_mass(seed, draw):
    """Rows of V = 1200 in 5 chunks of 256 (the split kernel's) with whole chunks masked: mass 1 on each of
    columns 0-255 and 768-1023, so every sum is exact. u = 0.5 puts the target on chunk 0's cumulative mass: its
    last column; a step to either side draws that column or the first after the masked run, never one inside it.
    u = 0 draws the last column with mass before the masked tail, u near 1 the first column; a lone finite logit in
    the partial last chunk is always drawn; a row without mass gives 0."""
    V = 1200
    assert split_plan(1, V, 5, 64, torch.device("cpu")) == (5, 256)
    logits = torch.full((7, V), NEG_INF, device=DEVICE)
    logits[:5, :256] = 0.0
    logits[:5, 768:1024] = 0.0
    logits[5, 1100] = 3.0
    u = torch.tensor([0.5, 0.5 - 2**-20, 0.5 + 2**-20, 0.0, 1 - 2**-24, 0.7, 0.3], device=DEVICE)

    tokens = draw(logits, u).tolist()

    assert tokens == [255, 768, 255, 1023, 0, 1100, 0], seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("V,P,split_block", SPLIT_CASES)
def test_split_kernels_draw_the_reference_token(seed, dtype, V, P, split_block):
    """Split rows (P = 2..6) of _random_rows' four kinds, the plain and the peaked row masked over a whole chunk and
    halves of its neighbours (at P = 2 to the end of the row, so the plain row's u = 0 draws the last column before
    it): the reference's token or a CDF-boundary tie, and the one-program kernel's up to a tie."""
    P_got, C = split_plan(4, V, P, split_block, torch.device(DEVICE))
    assert (P_got, V % C != 0) == (P, True)
    logits, u = _random_rows(4, V, dtype)
    logits[0::3, C // 2:2 * C + C // 2] = NEG_INF

    got = sample_from_logits(logits, u, splits=P, split_block=split_block)

    assert got.dtype == torch.int64 and got.shape == (4,)
    _check_draws(logits, u, got, seed)
    one = sample_from_logits(logits, u, splits=1)
    ties = cdf_boundary_ties(logits, u, got, one, TIE_RTOL)
    assert bool(ties.all()), f"split {got.tolist()} one program {one.tolist()} (torch.manual_seed({seed}))"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_kernels_at_a_chunk_boundary(seed, dtype):
    """Targets on the float64 CDF where a masked run starts, V = 1000 in 4 chunks of 256: columns 250-261 across
    the boundary at 256, and 512-773, chunk 2 whole and across 768. The 7 fp32 uniforms nearest each, so the chunk
    partials' sums and the rescan round to either side of the target: the draw is the last column before the run or
    the first after it, a tie with the reference and the one-program kernel, never a masked column."""
    V, P, block = 1000, 4, 128
    assert split_plan(1, V, P, block, torch.device("cpu")) == (P, 256)
    row = torch.randn(V, device=DEVICE) * 2
    for k in (1, 3):
        row[k * 256 - 6:k * 256 + 6] = NEG_INF
    row[512:768] = NEG_INF
    row = row.to(dtype)
    cdf = row.double().softmax(-1).cumsum(-1)
    u = []
    for run in (250, 512):  # the runs' first columns
        u0 = torch.tensor(1 - float(cdf[run - 1]), device=DEVICE)
        for _ in range(3):
            u0 = torch.nextafter(u0, torch.tensor(0.0, device=DEVICE))
        for _ in range(7):
            u.append(u0)
            u0 = torch.nextafter(u0, torch.tensor(1.0, device=DEVICE))
    u = torch.stack(u).float()
    logits = row.expand(len(u), V)

    got = sample_from_logits(logits, u, splits=P, split_block=block)

    _check_draws(logits, u, got, seed)
    one = sample_from_logits(logits, u, splits=1)
    ties = cdf_boundary_ties(logits, u, got, one, TIE_RTOL)
    assert bool(ties.all()), f"split {got.tolist()} one program {one.tolist()} (torch.manual_seed({seed}))"


def test_split_walk_goes_on_where_the_rescan_does_not_cross():
    """Kernel B on partials that put chunk 0's mass at 130 where its rescan sums to 128 (rounding's effect, made
    large): at a target of 128.5 the crossing chunk is 0, its rescan does not cross, and the walk goes on over the
    masked chunk 1 and the masked head of chunk 2 to the first column with mass, 266. At u = 0 the target is the
    partials' total, above every rescanned prefix: the last column with mass, 499 (chunk 3 masked from 500)."""
    V, C, block = 512, 128, 64
    logits = torch.zeros(2, V, device=DEVICE)
    logits[:, C:2 * C + 10] = NEG_INF
    logits[:, 500:] = NEG_INF
    part = torch.empty(2, 4, 2, device=DEVICE)
    _chunk_partials_kernel[(2, 4)](logits, part, V, V, C, BLOCK=block)
    assert part.tolist() == [[[0.0, 128.0], [NEG_INF, 0.0], [0.0, 118.0], [0.0, 116.0]]] * 2
    part[:, 0, 1] = 130.0
    u = torch.tensor([1 - 128.5 / 364, 0.0], device=DEVICE)
    out = torch.empty(2, dtype=torch.int64, device=DEVICE)

    _split_draw_kernel[(2,)](logits, u, part, out, V, V, 4, C, BLOCK=block, P_BLOCK=4)

    assert out.tolist() == [266, 499]


def test_split_plan_follows_batch_size_and_sm_count(monkeypatch):
    """Automatic splits on a 132-SM GPU over llama3's vocabulary: chunks of MIN_CHUNK at batch 1 and 4, fewer and
    longer chunks up the batch so (row, chunk) programs fill twice the SMs, one program per row from one row per SM
    on and off CUDA."""
    monkeypatch.setattr(triton_sampling, "_num_sms", lambda device: 132)
    cuda, V = torch.device("cuda"), 128256
    plans = {B: split_plan(B, V, None, 1024, cuda) for B in (1, 4, 16, 64, 131)}
    assert plans == {1: (63, 2048), 4: (63, 2048), 16: (16, 8192), 64: (5, 26624), 131: (3, 43008)}
    assert split_plan(132, V, None, 1024, cuda)[0] == split_plan(256, V, None, 1024, cuda)[0] == 1
    assert split_plan(1, V, None, 1024, torch.device("cpu")) == (1, V)


def _req(**sp) -> Request:
    seed = sp.pop("seed", None)
    req = Request(request_id=f"r{id(sp)}", prompt_token_ids=[0], sampling_params=SamplingParams(**sp), max_tokens=8)
    if seed is not None:
        req.generator = torch.Generator().manual_seed(seed)
    return req


def test_the_sampler_draws_with_the_kernel_as_with_the_reference(seed, monkeypatch):
    """core/sampler.py through sample_from_logits: the kernel in place of the reference (as on CUDA) draws the same
    tokens from the same generators, and greedy rows stay the argmax."""
    params = [dict(temperature=0.7, top_k=50, seed=1), dict(temperature=0.0), dict(top_p=0.9),
              dict(min_p=0.05, seed=2), dict(temperature=1.3)]
    logits = torch.randn(len(params), 1000, device=DEVICE) * 2
    expected = sampler_module.Sampler(seed=seed)(logits, [_req(**p) for p in params]).token_ids

    calls = []

    def kernel(scaled, u):
        calls.append((scaled, u))
        return sample_from_logits(scaled, u, block=256)

    monkeypatch.setattr(sampler_module, "for_device", lambda t: SimpleNamespace(sample_from_logits=kernel))
    got = sampler_module.Sampler(seed=seed)(logits, [_req(**p) for p in params]).token_ids

    assert len(calls) == 1
    scaled, u = calls[0]
    ties = cdf_boundary_ties(scaled, u, torch.tensor(got), torch.tensor(expected), TIE_RTOL)
    assert bool(ties.all()), (got, expected, seed)
    assert got[1] == int(logits[1].argmax())


def _bitmask_naive(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """xgrammar's layout read one token at a time: bit t % 32 of word t // 32, 1 = allowed."""
    out = logits.clone()
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            word = int(bitmask[j, t // 32]) & 0xFFFFFFFF if t // 32 < bitmask.shape[1] else 0
            if not (word >> (t % 32)) & 1:
                out[r, t] = NEG_INF
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_token_bitmask_kernel_equals_reference_on_random_logits(dtype):
    from vserve.kernels.sampling_ref import apply_token_bitmask_ref
    from vserve.kernels.triton_sampling import apply_token_bitmask

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    V = 1000  # not a multiple of 32 (the last word is partly past the vocabulary) nor of the kernel's block
    logits = torch.randn(7, V, generator=g).to(dtype)
    rows = [5, 0, 3]  # unordered, with rows left unconstrained between them
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (V + 31) // 32), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = 0  # a row with nothing allowed
    bitmask[2] = -1  # a row with everything allowed
    want = _bitmask_naive(logits, bitmask, rows)
    ref = logits.clone()
    apply_token_bitmask_ref(ref, bitmask, torch.tensor(rows))
    assert torch.equal(ref, want), seed
    got = logits.clone().to(DEVICE)
    apply_token_bitmask(got, bitmask.to(DEVICE), torch.tensor(rows, device=DEVICE), block=256)
    assert torch.equal(got.cpu(), want), seed
    assert torch.equal(got.cpu()[[1, 2, 4, 6]], logits[[1, 2, 4, 6]])  # other rows untouched


def test_warm_up_launches_both_draw_paths_and_the_bitmask(monkeypatch):
    """triton_sampling.warm_up (the engine's start on CUDA): a draw at batch 1 (the split path) and at one row per SM
    (the one-program path), and one bitmask over the vocabulary, so no step compiles a sampling kernel."""
    monkeypatch.setattr(triton_sampling, "_num_sms", lambda device: 132)
    calls = []
    monkeypatch.setattr(triton_sampling, "sample_from_logits", lambda logits, u: calls.append(("draw", *logits.shape)))
    monkeypatch.setattr(triton_sampling, "apply_token_bitmask",
                        lambda logits, mask, rows: calls.append(("mask", *mask.shape, rows.tolist())))
    triton_sampling.warm_up(1000, torch.device("cpu"))
    assert calls == [("draw", 1, 1000), ("draw", 132, 1000), ("mask", 1, 32, [0])]
    cuda = torch.device("cuda")
    assert split_plan(1, 1000 * 128, None, 1024, cuda)[0] > 1 and split_plan(132, 128000, None, 1024, cuda)[0] == 1
