"""Sampler semantics, each against a direct reference computation on random logits."""

from __future__ import annotations

import itertools

import pytest
import torch

from vserve.core.messages import Logprob, logprobs_dict
from vserve.core.request import Request
from vserve.core.sampler import (
    Sampler,
    TokenCounts,
    apply_penalties,
    apply_penalties_batched,
    top_k_top_p_min_p,
)
from vserve.core.sampling_params import SamplingParams

_ids = itertools.count()


def make_req(prompt=(0,), output=(), seed: int | None = None, **sp) -> Request:
    req = Request(request_id=f"r{next(_ids)}", prompt_token_ids=list(prompt),
                  sampling_params=SamplingParams(**sp), max_tokens=64)
    for t in output:
        req.append_token(t)
    if seed is not None:
        req.generator = torch.Generator().manual_seed(seed)
    return req


def random_logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def kept(logits: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(logits)


# ---- greedy -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_samples_the_argmax(seed):
    logits = random_logits(6, 50, seed)
    reqs = [make_req(temperature=1.0, top_k=1) for _ in range(6)]

    out = Sampler(seed=seed)(logits, reqs)

    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_temperature_0_is_the_argmax_whatever_the_other_rows_do(seed):
    logits = random_logits(6, 50, seed)
    reqs = [make_req(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]

    out = Sampler(seed=seed)(logits, reqs)

    assert out.token_ids[::2] == logits[::2].argmax(-1).tolist()


def test_the_plan_holds_while_the_batch_is_the_same_requests_and_follows_a_changed_one(seed):
    """The sampler keeps its plan (rows, filters, device columns) while a step samples the same request objects in
    the same order, and rebuilds it when the batch changes: reordered, shrunk or with other requests, each row is
    still sampled by its own request's parameters (greedy rows: the argmax; top_k=1 rows: the argmax too)."""
    greedy = [make_req(temperature=0.0) for _ in range(3)]
    drawn = [make_req(temperature=0.7, top_k=1, logprobs=2) for _ in range(3)]
    sampler = Sampler(seed=seed)
    batches = [greedy + drawn, list(greedy + drawn), drawn + greedy, drawn[:2], greedy[1:] + drawn[:1]]
    plans = []
    for i, reqs in enumerate(batches):
        logits = random_logits(len(reqs), 40, seed + i)
        out = sampler(logits, reqs)
        plans.append(sampler.plan)
        assert out.token_ids == logits.argmax(-1).tolist()
        assert [lp is not None for lp in out.logprobs] == [r in drawn for r in reqs]
    assert plans[1] is plans[0], "a copy of the same batch keeps the plan"
    assert len({id(p) for p in plans[1:]}) == 4, "a reordered, shrunk or different batch gets a new plan"


def test_greedy_takes_the_argmax_of_the_processed_logits():
    logits = random_logits(1, 50, 0)
    weakest = int(logits[0].argmin())

    out = Sampler()(logits, [make_req(temperature=0.0, logit_bias={weakest: 100.0})])

    assert out.token_ids == [weakest]


# ---- penalties ----------------------------------------------------------------------------------------------


def test_logit_bias_adds_exactly_its_values_to_its_tokens():
    logits = random_logits(2, 30, 1)
    reqs = [make_req(logit_bias={3: 1.5, 17: -100.0, 29: 0.25}), make_req()]
    expected = logits.clone()
    expected[0, 3] += 1.5
    expected[0, 17] += -100.0
    expected[0, 29] += 0.25

    apply_penalties(logits, reqs)

    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens_only():
    logits = random_logits(2, 20, 2)
    logits[0, [1, 3, 5, 7]] = torch.tensor([2.0, -1.0, 0.5, -3.0])
    req = make_req(prompt=[1, 3, 5], output=[5, 7], repetition_penalty=1.5)
    expected = logits.clone()
    for t in (1, 3, 5, 7):
        v = float(logits[0, t])
        expected[0, t] = v / 1.5 if v > 0 else v * 1.5

    apply_penalties(logits, [req, make_req(prompt=[1, 3])])

    torch.testing.assert_close(logits, expected)


def test_frequency_and_presence_penalties_subtract_per_output_token_counts_only():
    logits = random_logits(2, 20, 3)
    f, p = 0.5, 0.25
    req = make_req(prompt=[2, 4], output=[4, 6, 6, 6, 9], frequency_penalty=f, presence_penalty=p)
    expected = logits.clone()
    for t, count in {4: 1, 6: 3, 9: 1}.items():  # token 2 is only in the prompt: untouched
        expected[0, t] -= count * f + p

    apply_penalties(logits, [req, make_req(output=[4, 6])])

    torch.testing.assert_close(logits, expected)


def test_negative_frequency_and_presence_penalties_raise_repeated_tokens():
    logits = torch.zeros(1, 10)
    apply_penalties(logits, [make_req(output=[1, 1], frequency_penalty=-1.0, presence_penalty=-0.5)])

    expected = torch.zeros(1, 10)
    expected[0, 1] = 2.5
    torch.testing.assert_close(logits, expected)


def test_min_tokens_masks_the_stop_tokens_until_enough_outputs_exist():
    stops = {3, 7}
    logits = random_logits(3, 12, 4)
    reqs = [make_req(output=[], min_tokens=2, all_stop_token_ids=stops),
            make_req(output=[5], min_tokens=2, all_stop_token_ids=stops),
            make_req(output=[5, 6], min_tokens=2, all_stop_token_ids=stops)]
    expected = logits.clone()
    expected[:2, [3, 7]] = float("-inf")

    apply_penalties(logits, reqs)

    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_min_tokens_wins_over_a_logit_bias_towards_a_stop_token():
    logits = random_logits(1, 12, 5)
    req = make_req(temperature=0.0, min_tokens=1, logit_bias={3: 100.0}, all_stop_token_ids={3})

    assert Sampler()(logits, [req]).token_ids != [3]
    req.append_token(0)
    assert Sampler()(logits, [req]).token_ids == [3]


# ---- top_k / top_p / min_p ----------------------------------------------------------------------------------


def reference_keep(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Row by row, in float64: top_k largest, then the smallest prefix with mass >= top_p, then min_p."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for i, row in enumerate(logits.double()):
        order = row.argsort(descending=True).tolist()
        k = top_k[i] or len(order)
        order = order[:k]
        probs = row[order].softmax(-1)
        cum, n = 0.0, 0
        while n < len(order) and (n == 0 or cum < top_p[i]):
            cum += float(probs[n])
            n += 1
        order = order[:n]
        p = row[order].softmax(-1)
        order = [t for t, pt in zip(order, p.tolist()) if pt >= min_p[i] * float(p.max())]
        keep[i, order] = True
    return keep


def run_filter(logits, top_k, top_p, min_p):
    return top_k_top_p_min_p(logits, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))


@pytest.mark.parametrize("seed", range(4))
def test_top_k_keeps_exactly_the_k_largest_logits(seed):
    logits = random_logits(4, 40, seed)
    top_k = [0, 1, 5, 40]

    out = run_filter(logits, top_k, [1.0] * 4, [0.0] * 4)

    assert kept(out).sum(-1).tolist() == [40, 1, 5, 40]
    assert torch.equal(kept(out), reference_keep(logits, top_k, [1.0] * 4, [0.0] * 4))
    assert torch.equal(out[kept(out)], logits[kept(out)])


@pytest.mark.parametrize("seed", range(4))
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p(seed):
    logits = random_logits(5, 30, seed)
    top_p = [0.05, 0.3, 0.6, 0.9, 1.0]

    out = run_filter(logits, [0] * 5, top_p, [0.0] * 5)

    assert torch.equal(kept(out), reference_keep(logits, [0] * 5, top_p, [0.0] * 5))
    assert kept(out)[0].sum() >= 1
    assert bool(kept(out)[4].all())


@pytest.mark.parametrize("seed", range(4))
def test_top_p_applies_to_the_renormalised_top_k_distribution(seed):
    logits = random_logits(3, 30, seed)
    top_k, top_p = [4, 10, 0], [0.5, 0.8, 0.8]

    out = run_filter(logits, top_k, top_p, [0.0] * 3)

    assert torch.equal(kept(out), reference_keep(logits, top_k, top_p, [0.0] * 3))


@pytest.mark.parametrize("seed", range(4))
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(seed):
    logits = random_logits(4, 30, seed)
    min_p = [0.0, 0.05, 0.3, 1.0]

    out = run_filter(logits, [0] * 4, [1.0] * 4, min_p)

    assert torch.equal(kept(out), reference_keep(logits, [0] * 4, [1.0] * 4, min_p))
    assert kept(out)[3].sum() == 1


# ---- randomness ---------------------------------------------------------------------------------------------


def test_a_seeded_row_samples_the_same_tokens_alone_or_beside_other_rows():
    vocab, steps = 1000, 6
    target_logits = [random_logits(1, vocab, 100 + t, scale=1.0) for t in range(steps)]
    params = {"temperature": 0.8, "top_p": 0.95}

    alone_req = make_req(seed=1234, **params)
    alone_sampler = Sampler(seed=0)
    alone = [alone_sampler(target_logits[t], [alone_req]).token_ids[0] for t in range(steps)]

    batch_req = make_req(seed=1234, **params)
    batch_sampler = Sampler(seed=99)
    others = [make_req(temperature=1.0), make_req(seed=7, temperature=1.2), make_req(temperature=0.0),
              make_req(top_k=5)]
    beside = []
    for t in range(steps):
        rows = others[: 1 + t % len(others)]
        pos = t % (len(rows) + 1)
        reqs = rows[:pos] + [batch_req] + rows[pos:]
        logits = random_logits(len(reqs), vocab, 200 + t, scale=1.0)
        logits[pos] = target_logits[t][0]
        beside.append(batch_sampler(logits, reqs).token_ids[pos])

    other_seed_req = make_req(seed=4321, **params)
    other_seed = [Sampler(seed=0)(target_logits[t], [other_seed_req]).token_ids[0] for t in range(steps)]

    assert beside == alone
    assert other_seed != alone  # the seed, not the logits alone, decides the draw


def test_temperature_1_draws_match_the_softmax_probabilities():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    draws = 20000
    reqs = [make_req(temperature=1.0) for _ in range(draws)]

    tokens = Sampler(seed=0)(logits.expand(draws, -1).clone(), reqs).token_ids

    freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / draws
    assert float((freq - logits.double().softmax(-1)).abs().max()) < 0.02


def test_temperature_and_top_k_draws_match_the_renormalised_scaled_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    draws = 20000
    reqs = [make_req(temperature=0.5, top_k=3) for _ in range(draws)]

    tokens = Sampler(seed=1)(logits.expand(draws, -1).clone(), reqs).token_ids

    freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / draws
    expected = torch.zeros(5, dtype=torch.double)
    expected[[4, 0, 1]] = (logits[[4, 0, 1]].double() / 0.5).softmax(-1)
    assert float((freq - expected).abs().max()) < 0.02
    assert freq[[2, 3]].tolist() == [0.0, 0.0]


# ---- logprobs -----------------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_with_the_top_n_ranked_1_to_n():
    vocab = 20
    logits = random_logits(3, vocab, 6)
    weakest = int(logits[0].argmin())
    reqs = [make_req(temperature=0.0, logprobs=3, logit_bias={weakest: 100.0}),  # processed != raw
            make_req(temperature=1.0, logprobs=0, seed=5),
            make_req(temperature=1.0)]
    raw = logits.log_softmax(-1)

    out = Sampler()(logits, reqs)
    lps = [None if lp is None else logprobs_dict(lp) for lp in out.logprobs]

    chosen = out.token_ids[0]
    assert chosen == weakest
    top_vals, top_ids = raw[0].topk(3)
    expected = {chosen: Logprob(pytest.approx(float(raw[0, chosen]), abs=1e-6), vocab)}
    for rank, (v, t) in enumerate(zip(top_vals.tolist(), top_ids.tolist()), start=1):
        expected[t] = Logprob(pytest.approx(v, abs=1e-6), rank)
    assert lps[0] == expected
    assert list(lps[0])[0] == chosen  # the sampled token comes first

    t1 = out.token_ids[1]
    rank1 = int((raw[1] > raw[1, t1]).sum()) + 1
    assert lps[1] == {t1: Logprob(pytest.approx(float(raw[1, t1]), abs=1e-6), rank1)}
    assert lps[2] is None


def test_logprobs_hold_n_entries_when_the_sampled_token_is_among_the_top_n():
    logits = random_logits(1, 20, 7)
    out = Sampler()(logits, [make_req(temperature=0.0, logprobs=4)])

    lp = logprobs_dict(out.logprobs[0])
    assert list(lp)[0] == out.token_ids[0] and len(lp) == 4
    assert sorted(v.rank for v in lp.values()) == [1, 2, 3, 4]
    assert lp[out.token_ids[0]].rank == 1


# ---- the batched device path against the per-row reference -------------------------------------------------


def _random_reqs(rng: torch.Generator, vocab: int, rows: int) -> list[Request]:
    def pick(n):
        return torch.randint(0, vocab, (n,), generator=rng).tolist()

    kinds = [dict(), dict(repetition_penalty=1.7), dict(frequency_penalty=0.8, presence_penalty=-0.3),
             dict(logit_bias={int(t): float(b) for t, b in zip(pick(3), torch.randn(3, generator=rng) * 5)}),
             dict(min_tokens=6, all_stop_token_ids=set(pick(2))),
             dict(repetition_penalty=0.8, frequency_penalty=-0.5, min_tokens=3, all_stop_token_ids={1},
                  logit_bias={2: -3.0})]
    reqs = []
    for i in range(rows):
        n_out = int(torch.randint(0, 9, (1,), generator=rng))
        reqs.append(make_req(prompt=pick(int(torch.randint(1, 12, (1,), generator=rng))), output=pick(n_out),
                             **kinds[i % len(kinds)]))
    return reqs


@pytest.mark.parametrize("seed", range(4))
def test_batched_penalties_equal_the_per_row_reference(seed):
    rng = torch.Generator().manual_seed(seed)
    vocab = 40
    reqs = _random_reqs(rng, vocab, 12)
    logits = torch.randn(12, vocab, generator=rng) * 3
    want = logits.clone()
    apply_penalties(want, reqs)

    got = logits.clone()
    apply_penalties_batched(got, reqs, TokenCounts(vocab, got.device))

    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_token_counts_include_the_token_still_in_flight():
    """Under async scheduling a request's latest token is on the device, not yet in its host lists: the counts
    the sampler keeps already hold it, so the next step's penalties equal the reference with that token."""
    vocab = 30
    sampler = Sampler()
    req = make_req(prompt=[1, 2], output=[3], temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5,
                   repetition_penalty=1.3)
    logits = random_logits(1, vocab, 7)
    first = sampler.sample(logits.clone(), [req])
    req.num_pending = 1  # launched: its token is not appended yet
    second_logits = random_logits(1, vocab, 8)
    processed = second_logits.clone()
    apply_penalties_batched(processed, [req], sampler.counts)

    token = first.resolve().token_ids[0]
    req.append_token(token)
    req.num_pending = 0
    want = second_logits.clone()
    apply_penalties(want, [req])
    torch.testing.assert_close(processed, want, rtol=0, atol=0)
    sampler.release(req.request_id)
    assert sampler.counts.rows == {} and sampler.counts.num_counted == {}


def test_batched_logprobs_match_each_rows_log_softmax():
    logits = random_logits(5, 25, 9)
    reqs = [make_req(temperature=0.0, logprobs=n) for n in (0, 3, None, 5, 1)]
    out = Sampler()(logits, reqs)
    raw = logits.log_softmax(-1)
    for i, (req, entry) in enumerate(zip(reqs, out.logprobs)):
        n = req.sampling_params.logprobs
        if n is None:
            assert entry is None
            continue
        entry = logprobs_dict(entry)
        tok = out.token_ids[i]
        assert entry[tok].logprob == pytest.approx(float(raw[i, tok]))
        assert entry[tok].rank == int((raw[i] > raw[i, tok]).sum()) + 1
        top = raw[i].topk(n)
        want = {int(t): (float(v), r + 1) for r, (v, t) in enumerate(zip(top.values, top.indices))}
        want.setdefault(tok, (float(raw[i, tok]), entry[tok].rank))
        assert sorted(entry) == sorted(want)
        for t, lp in entry.items():
            assert (lp.logprob, lp.rank) == (pytest.approx(want[t][0]), want[t][1])
