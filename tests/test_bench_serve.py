"""`vserve bench serve` against a real `vserve serve` on loopback (tiny model), and against failing servers."""

import json
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from vserve.cli.bench_serve import _sse_events
from vserve.cli.main import app

runner = CliRunner()
MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(server_factory, tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "bench-server.log"
    return server_factory([str(tiny_dir), "--served-model-name", MODEL, "--dtype", "float32", "--device", "cpu",
                           "--max-model-len", "256"], log)


def bench(*args: str) -> dict:
    res = runner.invoke(app, ["bench", "serve", *args, "--json"], env={"VSERVE_NO_PROGRESS": "1"})
    assert res.exit_code == 0, res.output + res.stderr
    return json.loads(res.stdout)


def assert_consistent(run: dict, requests: list[dict]) -> None:
    ok = [r for r in requests if r["success"]]
    assert run["completed"] == len(ok) and run["failed"] == len(requests) - len(ok)
    assert run["total_output_tokens"] == sum(r["output_tokens"] for r in ok)
    for r in ok:
        assert 0 < r["ttft"] <= r["latency"]
        assert len(r["itl"]) <= r["output_tokens"] - 1
        assert r["ttft"] + sum(r["itl"]) <= r["latency"] + 1e-6
    for metric in ("ttft", "tpot", "itl", "e2el"):
        p50, p90, p99 = (run[f"p{p}_{metric}_ms"] for p in (50, 90, 99))
        assert 0 <= p50 <= p90 <= p99, metric
        assert run[f"median_{metric}_ms"] == p50


def test_serve_bench_against_vserve_counts_match_and_latencies_are_ordered(server, tiny_dir, tmp_path):
    out = bench("--base-url", server.url, "--tokenizer", str(tiny_dir), "--num-prompts", "8", "--input-len", "16:32",
                "--output-len", "6", "--max-concurrency", "4", "--goodput", "ttft:60000 tpot:60000",
                "--save-result", str(tmp_path / "r.json"), "--plot", str(tmp_path / "plots"))
    assert out["config"]["model"] == MODEL  # resolved through GET /v1/models
    (run,) = out["runs"]
    assert run["completed"] == 8 and run["failed"] == 0 and run["max_concurrency"] == 4
    assert run["total_output_tokens"] == 8 * 6  # ignore_eos: exactly --output-len each
    assert run["goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: every request is good
    saved = json.loads((tmp_path / "r.json").read_text())
    assert_consistent(saved["runs"][0], saved["runs"][0]["requests"])
    for name in ("latency_cdf.png", "throughput_over_time.png"):
        png = (tmp_path / "plots" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_serve_bench_chat_sweep_writes_one_run_per_level_and_sweep_plot(server, tiny_dir, tmp_path):
    out = bench("--base-url", server.url + "/v1", "--model", MODEL, "--tokenizer", str(tiny_dir), "--endpoint",
                "chat", "--dataset", "prefix", "--prefix-len", "24", "--num-prefixes", "2", "--input-len", "8",
                "--num-prompts", "6", "--output-len", "4", "--sweep-concurrency", "1,3", "--request-rate", "50",
                "--save-result", str(tmp_path / "r.json"), "--plot", str(tmp_path / "plots"))
    assert [r["max_concurrency"] for r in out["runs"]] == [1, 3]
    saved = json.loads((tmp_path / "r.json").read_text())
    for run in saved["runs"]:
        assert run["completed"] == 6 and run["total_output_tokens"] == 24
        assert_consistent(run, run["requests"])
    png = (tmp_path / "plots" / "sweep.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_serve_bench_counts_400s_as_failures(server, tiny_dir):
    # 64 prompt tokens + 300 output tokens exceed --max-model-len 256: every request is a 400 (sent in the stream).
    out = bench("--base-url", server.url, "--tokenizer", str(tiny_dir), "--num-prompts", "5", "--input-len", "64",
                "--output-len", "300")
    (run,) = out["runs"]
    assert run["completed"] == 0 and run["failed"] == 5 and run["total_output_tokens"] == 0
    assert sum(run["errors"].values()) == 5  # keyed by message, which names each prompt's length
    for e in run["errors"]:
        assert e.startswith("stream error 400: prompt (") and "--max-model-len 256" in e, e


def test_sse_events_keep_a_partial_line_for_the_next_read():
    buf = bytearray(b'data: {"a": 1}\n\ndata: {"b"')
    assert _sse_events(buf) == ['{"a": 1}'] and buf == bytearray(b'data: {"b"')
    assert _sse_events(buf) == [] and buf == bytearray(b'data: {"b"')  # still no line end
    buf += b': 2}\n\n: a comment\ndata:[DONE]\n\n'
    assert _sse_events(buf) == ['{"b": 2}', "[DONE]"] and buf == bytearray()


def test_serve_bench_counts_refused_connections_as_failures(tiny_dir):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = bench("--base-url", f"http://127.0.0.1:{port}", "--model", "x", "--tokenizer", str(tiny_dir),
                "--num-prompts", "3", "--input-len", "4", "--output-len", "2")
    (run,) = out["runs"]
    assert run["failed"] == 3 and all(e.startswith("ClientConnectorError") for e in run["errors"])


def test_serve_bench_unreachable_server_without_model_is_one_error_line(tiny_dir):
    res = runner.invoke(app, ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--tokenizer", str(tiny_dir),
                              "--num-prompts", "1"])
    assert res.exit_code == 2
    assert res.stderr.startswith("error: cannot reach --base-url 'http://127.0.0.1:1'")


def test_serve_bench_table_output(server, tiny_dir):
    res = runner.invoke(app, ["bench", "serve", "--base-url", server.url, "--tokenizer", str(tiny_dir),
                              "--num-prompts", "2", "--input-len", "8", "--output-len", "3", "--dataset", "chat"],
                        env={"VSERVE_NO_PROGRESS": "1", "COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "Online serving" in res.stdout and "TTFT p99 ms" in res.stdout and "output tok/s" in res.stdout


def test_serve_bench_counts_http_error_statuses_as_failures(server, tiny_dir):
    out = bench("--base-url", server.url, "--model", "no-such-model", "--tokenizer", str(tiny_dir),
                "--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--endpoint", "chat")
    (run,) = out["runs"]
    assert run["failed"] == 3 and run["completed"] == 0
    ((error, count),) = run["errors"].items()
    assert count == 3 and error.startswith("HTTP 404:"), error


def test_bench_help_imports_no_torch_or_matplotlib():
    code = """
import sys
from vserve.cli.main import app
for args in (["bench", "--help"], ["bench", "serve", "--help"], ["bench", "latency", "--help"],
             ["bench", "perplexity", "--help"], ["bench", "experiment", "paging", "--help"]):
    try:
        app(args, prog_name="vserve")
    except SystemExit as e:
        assert e.code == 0, (args, e.code)
assert "torch" not in sys.modules and "matplotlib" not in sys.modules
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_serve_bench_token_ids_sends_the_exact_workload(server, tiny_dir):
    out = bench("--base-url", server.url, "--tokenizer", str(tiny_dir), "--token-ids", "--num-prompts", "3",
                "--input-len", "8", "--output-len", "2")
    (run,) = out["runs"]
    assert run["completed"] == 3 and run["total_input_tokens"] == 24 and run["total_output_tokens"] == 6
