"""Models by hub id from a Hugging Face cache laid out as huggingface_hub writes it, with HF_HUB_OFFLINE=1: no test
here opens a connection; the cache is filled by tests/hf_cache.py."""

import json
import os
import subprocess
import sys

import httpx
import pytest
from hf_cache import put_in_hf_cache
from huggingface_hub import constants

from vserve import LLM, SamplingParams
from vserve.core import hub
from vserve.core.server.launch import served_model_names

REPO = "acme/tiny-llama"
PROMPTS = ["The capital of France is", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_model):
    """An HF_HOME whose hub cache holds REPO at main (tiny Llama, seed 1) and at tag v2 (another random model)."""
    home = tmp_path_factory.mktemp("hf-home")
    main, v2 = tiny_model("llama"), tiny_model("llama", initializer_range=0.3)
    put_in_hf_cache(main, home / "hub", REPO)
    put_in_hf_cache(v2, home / "hub", REPO, revision="v2")
    put_in_hf_cache(main, home / "hub", "acme/tokenizer-only", only=("tokenizer.json", "tokenizer_config.json"))
    return home, main, v2


@pytest.fixture
def offline(hf_home, monkeypatch):
    """This process as if started with HF_HOME=<the test cache> and HF_HUB_OFFLINE=1 (both are read at import)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home[0] / "hub"))
    return hf_home


def env_for(hf_home) -> dict:
    return {**os.environ, "HF_HOME": str(hf_home[0]), "HF_HUB_OFFLINE": "1", "VSERVE_NO_PROGRESS": "1"}


def texts(llm) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY)]


def token_ids(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_llm_by_hub_id_equals_the_local_folder_and_reads_the_snapshots_tokenizer(offline):
    home, main, _ = offline
    llm = LLM(REPO, **ENGINE)
    snapshot = hub.resolve(REPO)
    assert snapshot.parent.parent == home / "hub" / "models--acme--tiny-llama"
    assert llm.llm_engine.config.model == str(snapshot)
    assert llm.get_tokenizer().name_or_path == str(snapshot)
    assert token_ids(llm) == token_ids(LLM(str(main), **ENGINE))


def test_a_revision_resolves_by_its_ref_and_by_its_commit(offline):
    home, main, v2 = offline
    commit = (home / "hub" / "models--acme--tiny-llama" / "refs" / "v2").read_text()
    assert hub.resolve(REPO, revision="v2").name == commit != hub.resolve(REPO).name
    assert hub.resolve(REPO, revision=commit) == hub.resolve(REPO, revision="v2")
    by_tag = token_ids(LLM(REPO, revision="v2", **ENGINE))
    assert by_tag == token_ids(LLM(str(v2), **ENGINE))
    assert by_tag != token_ids(LLM(str(main), **ENGINE))


def test_tokenizer_by_hub_id(offline):
    _, main, _ = offline
    llm = LLM(str(main), tokenizer="acme/tokenizer-only", **ENGINE)
    assert llm.get_tokenizer().name_or_path == str(hub.resolve("acme/tokenizer-only", weights=False))
    assert texts(llm) == texts(LLM(str(main), **ENGINE))


def test_download_dir_is_a_cache_of_its_own(offline, tmp_path, tiny_model):
    put_in_hf_cache(tiny_model("llama"), tmp_path, "other/model")
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        hub.resolve("other/model")
    assert hub.resolve("other/model", download_dir=str(tmp_path)).is_relative_to(tmp_path)


def test_a_partial_snapshot_names_what_is_missing(offline, tmp_path, tiny_model):
    put_in_hf_cache(tiny_model("llama"), tmp_path, "acme/partial", only=("config.json", "tokenizer.json"))
    with pytest.raises(ValueError, match="only partly in the Hugging Face cache .*vserve download acme/partial"):
        hub.resolve("acme/partial", download_dir=str(tmp_path))
    # --load-format dummy needs no weights: config and tokenizer are enough
    assert hub.resolve("acme/partial", download_dir=str(tmp_path), weights=False).is_dir()


def test_gguf_by_quantization_from_the_cache(offline, tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    for name in ("tiny.Q4_K_M.gguf", "tiny.Q8_0.gguf", "README.md"):
        (folder / name).write_bytes(name.encode())
    put_in_hf_cache(folder, tmp_path / "cache", "acme/tiny-GGUF")
    cache = str(tmp_path / "cache")
    assert hub.resolve("acme/tiny-GGUF:Q8_0", download_dir=cache).read_bytes() == b"tiny.Q8_0.gguf"
    assert hub.resolve("acme/tiny-GGUF:q4_k_m", download_dir=cache).name == "tiny.Q4_K_M.gguf"
    assert hub.resolve("acme/tiny-GGUF", gguf_file="tiny.Q8_0.gguf", download_dir=cache).name == "tiny.Q8_0.gguf"
    with pytest.raises(ValueError, match=r"no GGUF file matching 'Q5_K_M' \(it has Q4_K_M, Q8_0\)"):
        hub.resolve("acme/tiny-GGUF:Q5_K_M", download_dir=cache)
    with pytest.raises(ValueError, match="GGUF files only: pick one with --gguf-file NAME or acme/tiny-GGUF:QUANT"):
        hub.resolve("acme/tiny-GGUF", download_dir=cache)


@pytest.mark.parametrize("model, is_hub", [("org/name", True), ("org/name:Q4_K_M", True), ("a.b/c-d_e", True),
                                           ("./org/name", False), ("/abs/path", False), ("~/m", False),
                                           ("plain", False), ("a/b/c", False), ("org/x.gguf", False),
                                           ("org--x/y", False)])
def test_what_counts_as_a_hub_id(model, is_hub):
    assert (hub.HubModel.parse(model) is not None) == is_hub


def test_served_model_names_default_to_the_id_as_typed(tmp_path):
    assert served_model_names("acme/tiny-llama", ()) == ("acme/tiny-llama",)
    assert served_model_names(str(tmp_path), ()) == (tmp_path.name,)
    assert served_model_names("acme/tiny-llama", ("a", "b")) == ("a", "b")


def test_generate_by_hub_id_offline(hf_home):
    _, main, _ = hf_home
    args = ["generate", *PROMPTS, "--max-tokens", "8", "--temperature", "0", "--dtype", "float32",
            "--device", "cpu", "--json"]
    run = [sys.executable, "-m", "vserve.cli.main"]
    by_id = subprocess.run([*run, *args, "--model", REPO], capture_output=True, text=True, env=env_for(hf_home))
    assert by_id.returncode == 0, by_id.stderr
    local = subprocess.run([*run, *args, "--model", str(main)], capture_output=True, text=True,
                           env=env_for(hf_home))
    assert [json.loads(line)["text"] for line in by_id.stdout.splitlines()] == \
        [json.loads(line)["text"] for line in local.stdout.splitlines()]


def test_generate_of_an_uncached_id_offline_is_one_error_line(hf_home):
    res = subprocess.run([sys.executable, "-m", "vserve.cli.main", "generate", "hi", "--model", "acme/missing"],
                         capture_output=True, text=True, env=env_for(hf_home))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"error: 'acme/missing' (revision main) is not in the Hugging Face cache {hf_home[0] / 'hub'} and "
        "HF_HUB_OFFLINE=1 forbids downloading it; run `vserve download acme/missing` where the hub can be reached, "
        "or unset HF_HUB_OFFLINE"]


def test_serve_by_hub_id_offline(hf_home, server_factory, tmp_path):
    _, main, _ = hf_home
    server = server_factory([REPO, "--served-model-name", REPO, "--served-model-name", "tiny", "--dtype", "float32",
                             "--device", "cpu", "--max-model-len", "512"], tmp_path / "serve.log",
                            env={"HF_HOME": str(hf_home[0]), "HF_HUB_OFFLINE": "1"})
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [REPO, "tiny"]
    expected = LLM(str(main), dtype="float32", device="cpu", max_model_len=512).generate(PROMPTS[0], GREEDY)
    for name in (REPO, "tiny"):  # every served name is accepted; the first is reported
        body = httpx.post(server.url + "/v1/completions", json={"model": name, "prompt": PROMPTS[0],
                                                                "max_tokens": 8, "temperature": 0}).json()
        assert (body["model"], body["choices"][0]["text"]) == (REPO, expected[0].outputs[0].text)


def test_doctor_plans_a_hub_id_from_its_cached_config(offline):
    from test_doctor import HEALTHY

    from vserve.ops.doctor import run_doctor

    _, main, _ = offline
    by_id, local = run_doctor(HEALTHY, model=REPO), run_doctor(HEALTHY, model=str(main))
    assert by_id.plan is not None and by_id.plan == local.plan
    download = by_id.check("download")
    assert (download.status, download.finding) == ("ok", f"in the Hugging Face cache: {hub.resolve(REPO)} "
                                                         "(HF_HUB_OFFLINE=1)")
    with pytest.raises(ValueError, match="has no config.json in the Hugging Face cache"):
        run_doctor(HEALTHY, model="acme/missing")


def test_serve_without_model_serves_vserve_model_from_the_environment(monkeypatch):
    """The Dockerfile bakes its MODEL build argument in as VSERVE_MODEL; a MODEL argument still wins."""
    from typer.testing import CliRunner

    from vserve.cli.main import app
    from vserve.core.server import launch

    seen = []
    monkeypatch.setattr(launch, "serve", lambda config, opts: seen.append(config.model) or 0)
    runner = CliRunner()
    env = {"VSERVE_MODEL": REPO, "VSERVE_NO_PROGRESS": "1"}
    assert runner.invoke(app, ["serve"], env=env).exit_code == 0
    assert runner.invoke(app, ["serve", "acme/other"], env=env).exit_code == 0
    assert runner.invoke(app, ["serve", "--model", "acme/third"], env=env).exit_code == 0
    assert seen == [REPO, "acme/other", "acme/third"]


def test_an_unreachable_hub_falls_back_to_a_complete_cached_snapshot(hf_home, monkeypatch, tmp_path, tiny_model):
    """Online, but nothing listens at HF_ENDPOINT (a closed loopback port): a complete snapshot in the cache is
    served, as huggingface_hub does; a partial one is the connection error in one line."""
    from conftest import free_port

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home[0] / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    assert hub.resolve(REPO).parent == hf_home[0] / "hub" / "models--acme--tiny-llama" / "snapshots"
    put_in_hf_cache(tiny_model("llama"), tmp_path, "acme/partial", only=("config.json",))
    with pytest.raises(ValueError, match="cannot reach the Hugging Face hub for 'acme/partial'"):
        hub.resolve("acme/partial", download_dir=str(tmp_path))
