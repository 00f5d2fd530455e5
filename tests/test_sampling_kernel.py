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
from vserve.kernels.sampling_ref import cdf_boundary_ties, sample_from_logits_ref  # noqa: E402
from vserve.kernels.triton_sampling import sample_from_logits  # noqa: E402

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


@pytest.mark.parametrize("draw", [sample_from_logits_ref, lambda x, u: sample_from_logits(x, u, block=64)],
                         ids=["reference", "kernel"])
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
