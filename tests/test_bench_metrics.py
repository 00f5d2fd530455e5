"""bench serve's metric functions on fixed timestamps, against values computed by hand."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vserve.cli.bench_datasets import chat_workload, make_workload, prefix_workload
from vserve.cli.bench_metrics import (
    RequestFuncOutput,
    output_throughput_over_time,
    parse_goodput,
    percentile,
    summarize,
)

# A: 4 tokens, B: 2 tokens, C: a 400, D: 1 token (no TPOT). The benchmark lasted 2 s.
A = RequestFuncOutput(True, 10, 4, start=0.0, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2)
B = RequestFuncOutput(True, 20, 2, start=0.5, ttft=0.3, itl=[0.1], latency=0.4)
C = RequestFuncOutput(False, 7, 0, start=0.6, error="HTTP 400: too long")
D = RequestFuncOutput(True, 5, 1, start=1.0, ttft=0.2, itl=[], latency=0.2)
OUTPUTS = [A, B, C, D]


def close(actual: float, expected: float) -> bool:
    return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-9)


def test_counts_and_throughputs():
    s = summarize(OUTPUTS, 2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (35, 7)  # the failure counts no tokens
    assert close(s["request_throughput"], 1.5) and close(s["output_throughput"], 3.5)
    assert close(s["total_token_throughput"], 21.0)
    assert s["errors"] == {"HTTP 400: too long": 1} and s["goodput"] is None


def test_ttft_tpot_itl_e2el_statistics_in_ms():
    s = summarize(OUTPUTS, 2.0)
    expected = {
        # TTFT 100, 300, 200 ms
        "ttft": {"mean": 200, "median": 200, "std": math.sqrt(20000 / 3), "p50": 200, "p90": 280, "p99": 298},
        # TPOT excludes the first token: A (200-100)/3 ms, B (400-300)/1 ms; D has one token, so none.
        "tpot": {"mean": 200 / 3, "median": 200 / 3, "std": 100 / 3, "p90": 100 / 3 + 200 / 3 * 0.9,
                 "p99": 100 / 3 + 200 / 3 * 0.99},
        # ITL 20, 30, 50, 100 ms
        "itl": {"mean": 50, "median": 40, "std": math.sqrt(950), "p90": 85, "p99": 98.5},
        # E2EL 200, 400, 200 ms
        "e2el": {"mean": 800 / 3, "median": 200, "std": math.sqrt(80000 / 9), "p90": 360, "p99": 396},
    }
    for metric, stats in expected.items():
        for stat, value in stats.items():
            assert close(s[f"{stat}_{metric}_ms"], value), (metric, stat, s[f"{stat}_{metric}_ms"], value)


def test_goodput_counts_requests_meeting_every_slo():
    # ttft <= 250 ms and tpot <= 50 ms: A (100, 33.3) and D (200, no TPOT) pass, B (300 ms TTFT) fails.
    assert close(summarize(OUTPUTS, 2.0, parse_goodput(["ttft:250 tpot:50"]))["goodput"], 1.0)
    assert close(summarize(OUTPUTS, 2.0, parse_goodput(["ttft:150"]))["goodput"], 0.5)  # A only
    assert close(summarize(OUTPUTS, 2.0, parse_goodput(["e2el:300", "tpot:200"]))["goodput"], 1.0)  # A and D


def test_parse_goodput_rejects_unknown_metric_and_bad_value():
    assert parse_goodput(["ttft:500", "tpot:50,e2el:2000"]) == {"ttft": 500, "tpot": 50, "e2el": 2000}
    for bad in ("itl:5", "ttft", "ttft:-1", "ttft:x"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_output_throughput_over_time_bins_token_chunks():
    # A's 4 chunks land in [0, 0.5), B's 2 at 0.8 and 0.9, D's one at 1.2; tokens / 0.5 s per bin.
    assert output_throughput_over_time(OUTPUTS, 0.5) == [(0.0, 8.0), (0.5, 4.0), (1.0, 2.0)]


def test_empty_run_summarizes_to_zeros():
    s = summarize([C], 1.0)
    assert s["completed"] == 0 and s["failed"] == 1 and s["p99_ttft_ms"] == 0.0 and s["output_throughput"] == 0.0


@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=50))
def test_percentiles_are_ordered_and_bounded(values):
    ps = [percentile(values, p) for p in (0, 10, 50, 90, 99, 100)]
    assert ps == sorted(ps) and ps[0] == min(values) and ps[-1] == max(values)


def test_datasets_are_seeded_and_shaped():
    w = prefix_workload(1, 6, prefix_len=32, num_prefixes=2, suffix_len=(4, 8), output_len=(3, 3),
                        vocab_size=100, special_ids={0, 1})
    assert [p[:32] for p in w.prompts[:2]] * 3 == [p[:32] for p in w.prompts]
    assert w.prompts[0][:32] != w.prompts[1][:32] and all(36 <= len(p) <= 40 for p in w.prompts)
    assert w.output_lens == [3] * 6 and all(t not in (0, 1) for p in w.prompts for t in p)
    c = chat_workload(2, 200, 100, set(), max_len=512)
    assert c == chat_workload(2, 200, 100, set(), max_len=512)
    assert all(len(p) + o <= 512 for p, o in zip(c.prompts, c.output_lens))
    assert len({len(p) for p in c.prompts}) > 50  # a spread of lengths, not one


def test_file_dataset_cycles_prompts(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("hello there\n\nsecond prompt\n")
    w = make_workload("file", seed=0, num_prompts=3, input_len=(1, 1), output_len=(5, 5), vocab_size=10,
                      special_ids=set(), encode=lambda t: [len(t)], dataset_path=str(f))
    assert w.texts == ["hello there", "second prompt", "hello there"] and w.prompts == [[11], [13], [11]]
    with pytest.raises(ValueError, match="--dataset must be one of"):
        make_workload("sharegpt", seed=0, num_prompts=1, input_len=(1, 1), output_len=(1, 1), vocab_size=10,
                      special_ids=set(), encode=len)
