"""The `vserve` CLI: fast --help/--version, one-line errors with status 2, generate and bench throughput."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from vserve.cli import bench, generate
from vserve.cli.main import app

runner = CliRunner()
_LLMS: dict = {}  # one model load shared by every test that generates


@pytest.fixture
def shared_llm(monkeypatch):
    """Commands given the same engine flags reuse one LLM instead of loading the model again."""
    real = generate.build_llm

    def build_llm(engine_args):
        key = tuple(sorted(engine_args.items()))
        if key not in _LLMS:
            _LLMS[key] = real(engine_args)
        return _LLMS[key]

    monkeypatch.setattr(generate, "build_llm", build_llm)
    monkeypatch.setattr(bench, "build_llm", build_llm)


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"VSERVE_NO_PROGRESS": "1"})


def test_help_and_version_import_no_torch():
    code = """
import sys
from vserve.cli.main import app
for args in (["--help"], ["--version"], ["generate", "--help"], ["bench", "throughput", "--help"]):
    try:
        app(args, prog_name="vserve")
    except SystemExit as e:
        assert e.code == 0, (args, e.code)
assert "torch" not in sys.modules, "torch was imported"
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})  # wide enough for untruncated flag names
    assert res.returncode == 0, res.stderr
    import vserve

    assert vserve.__version__ in res.stdout.splitlines()
    assert "--max-num-batched-tokens" in res.stdout and "--print-config" in res.stdout


def test_bad_block_size_exits_2_with_one_error_line():
    res = invoke("generate", "hi", "--block-size", "7")
    assert res.exit_code == 2
    assert res.stderr.splitlines() == ["error: --block-size must be one of 16, 32, 64, 128, 256, got 7"]
    assert res.stdout == ""


def test_unknown_structured_outputs_backend_exits_2_with_one_error_line():
    res = invoke("generate", "hi", "--structured-outputs-backend", "outlines")
    assert res.exit_code == 2
    assert res.stderr.splitlines() == ["error: --structured-outputs-backend must be one of auto, xgrammar, guidance, "
                                       "got 'outlines'"]


def test_nonexistent_model_exits_2_with_one_error_line(tmp_path):
    missing = tmp_path / "no-such-model"
    res = invoke("generate", "hi", "--model", str(missing))
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [f"error: model path {str(missing)!r} does not exist"]


def test_no_prompt_exits_2_with_one_error_line():
    res = invoke("generate")
    assert res.exit_code == 2
    assert res.stderr.splitlines() == ["error: no prompt: pass one or more PROMPT arguments or --file "
                                       "prompts.txt|.jsonl"]


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": \n')
    res = invoke("generate", "--file", str(f))
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [f"error: {f}:2: not valid JSON (Expecting value)"]


def test_every_engine_config_field_is_a_flag():
    from dataclasses import fields

    from vserve.cli.engine_args import ENGINE_FLAGS
    from vserve.core.config import EngineConfig

    assert [f.name for f in ENGINE_FLAGS] == [f.name for f in fields(EngineConfig) if f.name != "sources"]


def test_print_config_shows_flag_sources_before_running():
    res = invoke("generate", "--block-size", "32", "--print-config")
    assert res.exit_code == 2  # no prompt: the table is printed first
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in res.stderr.splitlines() if line.startswith("│")}
    assert rows["--block-size"] == ["32", "flag"]
    assert rows["--max-num-seqs"] == ["256", "default"]


def test_read_prompts_txt_and_jsonl(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\n  \nsecond \n")
    assert generate.read_prompts(txt) == ["first", "second "]
    jsonl = tmp_path / "p.jsonl"
    msgs = [{"role": "user", "content": "hi"}]
    jsonl.write_text(json.dumps({"prompt": "a"}) + "\n\n" + json.dumps({"messages": msgs}) + "\n")
    assert generate.read_prompts(jsonl) == ["a", msgs]
    assert generate.conversation("q", "be brief") == [{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "q"}]


def test_length_ranges_and_workload_are_deterministic():
    assert bench.parse_len("--input-len", "16") == (16, 16)
    assert bench.parse_len("--input-len", "32:64") == (32, 64)
    for bad in ("0", "8:4", "x", "1:2:3"):
        with pytest.raises(ValueError, match="--input-len must be N or A:B"):
            bench.parse_len("--input-len", bad)
    a = bench.random_workload(3, 8, (32, 64), (2, 9), 100, {0, 1, 2})
    assert a == bench.random_workload(3, 8, (32, 64), (2, 9), 100, {0, 1, 2})
    assert all(32 <= len(p) <= 64 and min(p) >= 3 for p in a.prompts)
    assert all(2 <= o <= 9 for o in a.output_lens)


def test_generate_streams_greedy_paris(shared_llm):
    res = invoke("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert res.exit_code == 0, res.output
    assert "Paris" in res.stdout


def test_generate_json_lines_from_args_and_file(shared_llm, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("One plus one is\n\nThe capital of France is\n")
    res = invoke("generate", "Hello", "--file", str(f), "--json", "--max-tokens", "4", "--temperature", "0")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "One plus one is", "The capital of France is"]
    for r in rows:
        assert set(r) == {"prompt", "text", "token_ids", "finish_reason", "index"}
        assert 1 <= len(r["token_ids"]) <= 4 and r["index"] == 0 and r["finish_reason"] in ("stop", "length")
    assert "Paris" in rows[2]["text"]


def test_prompt_longer_than_max_model_len_exits_2(shared_llm):
    res = invoke("generate", "The capital of France is", "--max-model-len", "3", "--no-stream")
    assert res.exit_code == 2
    assert res.stderr.splitlines() == ["error: prompt has 5 tokens, which leaves no room to generate within "
                                       "--max-model-len 3"]


def test_bench_throughput_json(shared_llm):
    res = invoke("bench", "throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert (r["backend"], r["num_requests"], r["prompt_tokens"], r["output_tokens"]) == ("vserve", 4, 64, 16)
    assert r["elapsed_s"] > 0
    assert r["output_tokens_per_s"] == pytest.approx(16 / r["elapsed_s"])
    assert r["total_tokens_per_s"] == pytest.approx(80 / r["elapsed_s"])


def test_bench_throughput_json_schema_on_half_the_requests(shared_llm, tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["n"], "additionalProperties": False}))
    res = invoke("bench", "throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "40", "--json",
                 "--json-schema", str(f), "--sampling-fraction", "0.5")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    # two requests generate 40 tokens; the two with the schema end with their JSON ({"n": D}, at most 16 spaces
    # between two elements), before 40 tokens
    assert 80 < r["output_tokens"] < 160
    assert r["sampling"] == {"structured_outputs": str(f), "fraction": 0.5}
    # the grammar costs: compiled once cold, then the front end's cache; the core's mask fills on the steps with a
    # constrained row (at most the two constrained requests per fill), each of their tokens advanced once
    g = r["structured"]
    assert g["compile_cold_s"] > 0 and 0 <= g["compile_cached_s"] < g["compile_cold_s"]
    # the core's first grammar and the bitmask path are warmed up before the timed run (its one-time cost, timed)
    assert g["first_structured_request_s"] > 0
    assert 0 < g["steps_with_grammar"] <= 40 and 1 <= g["bitmask_rows_per_step"] <= 2
    assert g["bitmask_fill_ms_per_step"] > 0 and g["accept_us_per_token"] > 0
    assert g["elapsed_ms_per_step"] * g["steps_with_grammar"] == pytest.approx(r["elapsed_s"] * 1e3)
    # then the same requests without the schema, each to the length it generated: the schema's cost at equal lengths
    same = g["unconstrained_same_lengths"]
    assert (same["backend"], same["num_requests"], same["prompt_tokens"], same["output_tokens"]) == (
        "vserve, no schema", 4, r["prompt_tokens"], r["output_tokens"])
    assert g["ratio_same_lengths"] == pytest.approx(same["elapsed_s"] / r["elapsed_s"])


def test_generate_json_schema_constrains_every_output(shared_llm, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(schema))
    res = invoke("generate", "A city as JSON:", "--json-schema", str(f), "--json", "--n", "3", "--max-tokens", "60",
                 "--temperature", "1")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert r["finish_reason"] == "stop"
        jsonschema.validate(json.loads(r["text"]), schema)
    f.write_text("{oops")
    res = invoke("generate", "x", "--json-schema", str(f))
    assert res.exit_code == 2 and res.stderr.splitlines()[0].startswith(f"error: --json-schema {f} is not JSON")
