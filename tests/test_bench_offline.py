"""`vserve bench latency`, `bench perplexity`, `bench experiment paging` and the throughput datasets, on a
tiny random model on CPU."""

import json
import math

import pytest
from typer.testing import CliRunner

from vserve.cli.bench_experiment import cv, parse_mixes
from vserve.cli.bench_latency import summarize_latency
from vserve.cli.bench_perplexity import windows
from vserve.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return ["--model", str(tiny_model("llama")), "--device", "cpu", "--dtype", "float32"]


def run_json(*args: str) -> dict:
    res = runner.invoke(app, ["bench", *args, "--json"], env={"VSERVE_NO_PROGRESS": "1"})
    assert res.exit_code == 0, res.output + res.stderr
    return json.loads(res.stdout)


def test_latency_reports_ordered_percentiles(tiny):
    out = run_json("latency", "--batch-size", "3", "--input-len", "8", "--output-len", "4", "--num-iters", "4",
                   "--num-iters-warmup", "1", "--max-model-len", "64", *tiny)
    assert len(out["latencies_s"]) == 4 and len(out["ttfts_s"]) == 4
    ps = [out[f"p{p}_latency_s"] for p in (10, 25, 50, 75, 90, 99)]
    assert ps == sorted(ps) and min(out["latencies_s"]) <= ps[0] and ps[-1] <= max(out["latencies_s"])
    assert all(0 < f < t for f, t in zip(out["ttfts_s"], out["latencies_s"])) and out["decode_tokens_per_s"] > 0


def test_latency_summary_matches_hand_computed():
    s = summarize_latency([1.0, 2.0, 3.0], [0.5, 0.5, 0.5], batch_size=2, output_len=11)
    assert s["avg_latency_s"] == 2.0 and s["p50_latency_s"] == 2.0 and math.isclose(s["p90_latency_s"], 2.8)
    assert math.isclose(s["p10_latency_s"], 1.2) and s["avg_ttft_s"] == 0.5
    assert math.isclose(s["decode_tokens_per_s"], 2 * 10 / 1.5)  # 20 decode tokens in a mean 1.5 s after TTFT


def test_perplexity_windows_score_every_token_once():
    for n, length, stride in ((10, 4, 2), (10, 4, 4), (5, 16, 8), (2, 2, 1), (100, 7, 3)):
        scored = [t for b, e, first in windows(n, length, stride) for t in range(first, e)]
        assert scored == list(range(1, n)), (n, length, stride)
        assert all(e - b <= length for b, e, _ in windows(n, length, stride))


def test_perplexity_equals_hf_loss_in_one_window(tiny, tiny_model, tmp_path):
    import torch
    import transformers

    text = "the quick brown fox jumps over the lazy dog. " * 4
    (tmp_path / "t.txt").write_text(text)
    out = run_json("perplexity", "--data", str(tmp_path / "t.txt"), "--max-length", "512", *tiny)
    folder = tiny_model("llama")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert out["tokens"] == ids.shape[1] - 1
    assert math.isclose(out["perplexity"], math.exp(loss), rel_tol=1e-4)
    # A sliding window scores the same tokens with less context: a finite, different number.
    slid = run_json("perplexity", "--data", "shakespeare", "--max-length", "32", "--stride", "16", *tiny)
    assert slid["tokens"] > 400 and math.isfinite(slid["perplexity"])


def test_paging_experiment_rows_and_kv_accounting(tiny):
    out = run_json("experiment", "paging", "--mixes", "2x64,16x8", "--output-len", "4", "--repeats", "2",
                   "--block-size", "16", *tiny)
    rows = {(r["backend"].split()[0], r["mix"]): r for r in out["rows"]}
    assert set(rows) == {("paged", "2x64"), ("paged", "16x8"), ("contiguous", "2x64"), ("contiguous", "16x8")}
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
    # Paged: 2 requests x 4 blocks of 16, or 16 requests x 1 block; contiguous: batch x padded length.
    assert rows["paged", "2x64"]["kv_peak_bytes"] == 8 * 16 * per_token
    assert rows["paged", "16x8"]["kv_peak_bytes"] == 16 * 16 * per_token
    assert rows["contiguous", "16x8"]["kv_peak_bytes"] == 16 * 8 * per_token
    for r in out["rows"]:
        assert r["total_tokens"] == 128 and r["tokens_per_s"] > 0 and r["throughput_cv"] >= 0
        assert r["p90_latency_s"] > 0


def test_parse_mixes_and_cv():
    assert [m.lengths for m in parse_mixes("2x4+1x8", 2)] == [[4, 4, 8]]
    with pytest.raises(ValueError, match="same total tokens"):
        parse_mixes("4x2048,32x128", 64)
    with pytest.raises(ValueError, match="--mixes takes"):
        parse_mixes("4x64", 64)
    assert cv([2.0, 2.0]) == 0.0 and math.isclose(cv([1.0, 3.0]), 0.5)


def test_throughput_prefix_and_file_datasets(tiny, tmp_path):
    out = run_json("throughput", "--num-prompts", "4", "--input-len", "4", "--output-len", "3", "--dataset", "prefix",
                   "--prefix-len", "16", "--num-prefixes", "2", *tiny)
    assert out["dataset"] == "prefix" and out["output_tokens"] == 12 and out["prompt_tokens"] == 4 * (16 + 4)
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hello there"}\n{"prompt": "Once upon a time"}\n')
    out = run_json("throughput", "--num-prompts", "3", "--output-len", "2", "--dataset", "file", "--dataset-path",
                   str(tmp_path / "p.jsonl"), *tiny)
    assert out["num_requests"] == 3 and out["output_tokens"] == 6


def test_throughput_gives_extra_sampling_to_a_fraction_of_requests(tiny, monkeypatch):
    """--repetition-penalty and --logprobs go to --sampling-fraction of the requests, spread evenly; the rest keep
    the plain parameters; a bad value is a one-line error before the model loads."""
    import vserve.cli.bench as bench

    seen = []
    orig = bench.run_vserve

    def recording(llm, w, extra=None, fraction=1.0, **kw):
        real = llm.generate

        def generate(prompts, params=None, **kw):
            if isinstance(params, list):
                seen.extend((p.repetition_penalty, p.logprobs) for p in params)
            return real(prompts, params, **kw)
        llm.generate = generate
        return orig(llm, w, extra, fraction, **kw)

    monkeypatch.setattr(bench, "run_vserve", recording)
    out = run_json("throughput", "--num-prompts", "6", "--input-len", "4", "--output-len", "3",
                   "--repetition-penalty", "1.1", "--logprobs", "2", "--sampling-fraction", "0.5", *tiny)
    assert out["output_tokens"] == 18 and out["sampling"] == {"repetition_penalty": 1.1, "logprobs": 2,
                                                               "fraction": 0.5}
    assert seen == [(1.0, None), (1.1, 2)] * 3
    res = runner.invoke(app, ["bench", "throughput", "--repetition-penalty", "-1", *tiny])
    assert res.exit_code == 2 and "repetition_penalty" in res.output + res.stderr
