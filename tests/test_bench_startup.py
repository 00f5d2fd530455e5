"""`vserve bench startup`: real `vserve serve` / `vserve generate` processes, started cold and warm, timed from
process start, with the phases each process reports."""

import json

import pytest
from typer.testing import CliRunner

from vserve.cli.engine_args import ENGINE_FLAGS, engine_argv
from vserve.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model("llama")


def bench(*args: str):
    res = runner.invoke(app, ["bench", "startup", *args, "--json"], env={"VSERVE_NO_PROGRESS": "1"})
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_serve_start_up_is_timed_cold_and_warm_with_each_process_phases(tiny_dir):
    out = bench("--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
                "--num-iters-cold", "1", "--num-iters-warm", "1")
    assert out["mode"] == "serve" and [r["cache"] for r in out["runs"]] == ["cold", "warm"]
    for run in out["runs"]:
        assert run["seconds"] > 0 and run["report"]["ready_s"] > 0
        api, engine = run["report"]["phases"], run["report"]["engine_process"]["phases"]
        assert list(api) == ["imports", "resolve model", "tokenizer", "engine process", "server"]
        # The engine process loads no tokenizer: the front end detokenizes.
        assert list(engine) == ["imports", "resolve model", "weights", "kv cache"]
        assert all(v >= 0 for v in [*api.values(), *engine.values()])


def test_generate_start_up_is_timed_to_the_first_token(tiny_dir):
    out = bench("--mode", "generate", "--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu",
                "--num-iters-cold", "0", "--num-iters-warm", "1")
    (run,) = out["runs"]
    assert run["cache"] == "warm" and run["seconds"] > 0
    assert list(run["report"]["phases"]) == ["imports", "resolve model", "tokenizer", "weights", "kv cache"]


def test_bad_mode_is_one_error_line():
    res = runner.invoke(app, ["bench", "startup", "--mode", "boot"])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == ["error: --mode must be one of serve, generate, got 'boot'"]


def test_engine_argv_gives_the_same_engine_args_back():
    from vserve.cli.engine_args import engine_command

    given = {f.name: None for f in ENGINE_FLAGS}
    given.update(model="m", dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_num_seqs=8,
                 tensor_parallel_size=2, gpu_memory_utilization=0.5)
    seen = {}

    @engine_command
    def probe(*, engine_args):
        seen.update(engine_args)

    import typer

    cli = typer.Typer()
    cli.command()(probe)
    res = runner.invoke(cli, engine_argv(given))
    assert res.exit_code == 0, res.output
    assert seen == given
