"""Downloading models by hub id (`vserve download`, `LLM(model="org/name")`) from tests/hub_server.py, a local
stand-in for the Hugging Face hub on 127.0.0.1: huggingface_hub speaks its real protocol to it, and no test here
reaches huggingface.co. Each test gets a fresh server and an empty cache folder (--download-dir)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_cache import blob_name
from hub_server import HubServer, folder_files
from huggingface_hub import constants
from typer.testing import CliRunner

from vserve import LLM, SamplingParams
from vserve.cli.main import app
from vserve.core import hub as vhub

runner = CliRunner()
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["The capital of France is", "Once upon a time"]
# Files a model repo holds that serving never needs: none of them may be downloaded.
NOT_SERVED = {"pytorch_model.bin": b"\x80\x02pickle" * 64, "original/consolidated.pth": b"\x80\x02pickle" * 64,
              "original/params.json": b'{"dim": 64}', "README.md": b"# tiny\n", ".gitattributes": b"*.bin lfs\n",
              "onnx/model.onnx": b"onnx" * 64}


@pytest.fixture
def hub(monkeypatch):
    """The stand-in hub, with this process's huggingface_hub pointed at it (online, no token)."""
    with HubServer() as server:
        server.use(monkeypatch)
        yield server


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "hub-cache"


@pytest.fixture(scope="module")
def tiny(tiny_model) -> Path:
    """A tiny random Llama (hidden 64, 2 layers) saved as safetensors, with SmolLM2's tokenizer files."""
    return tiny_model("llama")


@pytest.fixture(scope="module")
def sharded(tiny, tmp_path_factory) -> Path:
    """The tiny Llama saved in several safetensors shards with model.safetensors.index.json."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-sharded")
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="8MB")
    for f in tiny.iterdir():
        if not f.name.startswith("model") and not (folder / f.name).exists():
            (folder / f.name).write_bytes(f.read_bytes())
    assert (folder / "model.safetensors.index.json").exists() and not (folder / "model.safetensors").exists()
    return folder


def download(*args: str):
    return runner.invoke(app, ["download", *args], env={"VSERVE_NO_PROGRESS": "1"})


def error_line(res) -> str:
    """The one `error: ...` line a failed command printed (status 2, nothing else on stderr, no traceback)."""
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    return lines[0]


def snapshot_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def token_ids(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def assert_hf_cache_layout(cache: Path, repo_id: str, commit: str, files: dict[str, bytes]) -> Path:
    """models--org--name/{refs/main, blobs/<sha>, snapshots/<commit>/<path> -> relative symlinks to the blobs},
    holding exactly `files`; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    assert (repo / "refs" / "main").read_text() == commit
    snapshot = repo / "snapshots" / commit
    assert [p.name for p in (repo / "snapshots").iterdir()] == [commit]
    assert snapshot_files(snapshot) == files
    for name, data in files.items():
        link = snapshot / name
        assert link.is_symlink() and not os.path.isabs(os.readlink(link)), name
        assert link.resolve() == (repo / "blobs" / blob_name(data, name)).resolve(), name
    assert sorted(p.name for p in (repo / "blobs").iterdir()) == sorted(blob_name(d, n) for n, d in files.items())
    return snapshot


# ---- what a download fetches, and where it puts it ------------------------------------------------------------


def test_download_fetches_only_config_tokenizer_and_safetensors_into_the_standard_cache(hub, cache, tiny):
    served = folder_files(tiny)
    repo = hub.add("org/tiny", {**served, **NOT_SERVED})
    res = download("org/tiny", "--download-dir", str(cache))
    assert res.exit_code == 0, res.output
    commit = repo.revisions["main"]
    snapshot = assert_hf_cache_layout(cache, "org/tiny", commit, served)
    assert res.stdout.splitlines() == [str(snapshot)]
    assert sorted(hub.fetched()) == sorted(served)  # each once; nothing of NOT_SERVED
    assert "model.safetensors" in served and "tokenizer.json" in served


def test_llm_by_hub_id_downloads_and_generates_as_the_local_folder_and_a_second_start_fetches_nothing(
        hub, cache, tiny):
    served = folder_files(tiny)
    hub.add("org/tiny", {**served, **NOT_SERVED})
    llm = LLM("org/tiny", download_dir=str(cache), **ENGINE)
    snapshot = vhub.resolve("org/tiny", download_dir=str(cache))
    assert llm.llm_engine.config.model == str(snapshot)
    assert snapshot_files(snapshot) == served
    assert token_ids(llm) == token_ids(LLM(str(tiny), **ENGINE))
    assert sorted(hub.fetched()) == sorted(served)

    hub.clear()
    again = LLM("org/tiny", download_dir=str(cache), **ENGINE)
    assert again.llm_engine.config.model == str(snapshot)
    res = download("org/tiny", "--download-dir", str(cache))
    assert res.exit_code == 0 and res.stdout.splitlines() == [str(snapshot)]
    assert hub.file_requests() == []  # not a GET, not even a HEAD: the commit's files are all in the cache
    assert {r.path.split("?")[0] for r in hub.requests} == {"/api/models/org/tiny/revision/main"}


def test_a_sharded_repo_downloads_the_shards_of_its_index_and_skips_consolidated(hub, cache, sharded):
    served = folder_files(sharded)
    shards = sorted(f for f in served if f.endswith(".safetensors"))
    assert len(shards) >= 2
    hub.add("org/sharded", {**served, "consolidated.safetensors": b"\0" * 4096,
                            "model-00009-of-00009.safetensors": b"\0" * 4096, **NOT_SERVED})
    res = download("org/sharded", "--download-dir", str(cache))
    assert res.exit_code == 0, res.output
    assert snapshot_files(Path(res.stdout.strip())) == served
    assert sorted(f for f in hub.fetched() if f.endswith(".safetensors")) == shards
    assert sorted(hub.fetched()) == sorted(served)
    hub.clear()
    again = download("org/sharded", "--download-dir", str(cache))
    assert again.exit_code == 0 and again.stdout == res.stdout
    assert hub.fetched() == []


def test_tokenizer_only_downloads_no_weights(hub, cache, tiny):
    served = folder_files(tiny)
    hub.add("org/tiny", {**served, **NOT_SERVED})
    res = download("org/tiny", "--tokenizer-only", "--download-dir", str(cache))
    assert res.exit_code == 0, res.output
    meta = {n: d for n, d in served.items() if not n.endswith(".safetensors")}
    assert "tokenizer.json" in meta and "config.json" in meta
    assert snapshot_files(Path(res.stdout.strip())) == meta
    assert sorted(hub.fetched()) == sorted(meta)


# ---- refusals and hub errors: one line, status 2, nothing downloaded ------------------------------------------


def test_a_pickle_only_repo_is_refused_and_nothing_is_downloaded(hub, cache, tiny):
    files = {n: d for n, d in folder_files(tiny).items() if not n.endswith(".safetensors")}
    hub.add("org/pickled", {**files, "pytorch_model.bin": b"\x80\x02pickle" * 64})
    line = error_line(download("org/pickled", "--download-dir", str(cache)))
    assert "'org/pickled' has only pickled weights (pytorch_model.bin)" in line
    assert "safetensors" in line and "pickle can run code" in line
    assert hub.file_requests() == []
    assert not (cache / "models--org--pickled").exists()


@pytest.mark.parametrize("access", ["gated", "private"])
def test_a_gated_or_private_repo_says_accept_the_license_and_set_hf_token(hub, cache, tiny, access):
    hub.add("org/locked", folder_files(tiny), **{access: True}, token="hf_good")
    line = error_line(download("org/locked", "--download-dir", str(cache)))
    assert "'org/locked'" in line and "(HTTP 401)" in line and "gated" in line
    assert "accept the license" in line and "HF_TOKEN" in line and "--hf-token" in line
    assert hub.fetched() == []
    assert not any(r.authorized for r in hub.requests)  # no token of the machine's leaked into the test


def test_the_right_token_opens_a_gated_repo_and_is_not_sent_to_the_cdn(hub, cache, tiny):
    served = folder_files(tiny)
    hub.add("org/gated", served, gated=True, token="hf_good")
    res = download("org/gated", "--download-dir", str(cache), "--hf-token", "hf_good")
    assert res.exit_code == 0, res.output
    assert snapshot_files(Path(res.stdout.strip())) == served
    on_hub = [r for r in hub.requests if not r.cdn]
    on_cdn = [r for r in hub.requests if r.cdn]
    assert on_hub and all(r.authorized for r in on_hub)
    assert [r.file for r in on_cdn] == ["model.safetensors"] and not any(r.authorized for r in on_cdn)


def test_an_unknown_repo_is_not_found(hub, cache):
    line = error_line(download("org/missing", "--download-dir", str(cache)))
    assert line == ("error: model 'org/missing' is neither a local path nor a repo on the Hugging Face hub; check "
                    "the id (org/name)")
    assert not (cache / "models--org--missing" / "snapshots").exists()


def test_an_unknown_revision_is_named(hub, cache, tiny):
    hub.add("org/tiny", folder_files(tiny), revisions={"main": "a" * 40, "v1": "b" * 40})
    line = error_line(download("org/tiny", "--revision", "nope", "--download-dir", str(cache)))
    assert line.startswith("error: revision 'nope' not found in 'org/tiny'") and "--revision" in line
    assert hub.fetched() == []
    res = download("org/tiny", "--revision", "v1", "--download-dir", str(cache))  # a tag resolves to its commit
    assert res.exit_code == 0, res.output
    assert Path(res.stdout.strip()).name == "b" * 40


def test_a_full_disk_is_one_line_before_any_download(hub, cache, tiny, monkeypatch):
    hub.add("org/tiny", folder_files(tiny))
    monkeypatch.setattr(vhub, "free_bytes", lambda path: 1000)
    line = error_line(download("org/tiny", "--download-dir", str(cache)))
    need = sum(len(v) for k, v in folder_files(tiny).items() if k.endswith((".json", ".safetensors", ".jinja")))
    assert line.startswith(f"error: not enough disk space for 'org/tiny': its files need {need / 1e6:.1f} MB, ")
    assert "--download-dir" in line
    assert hub.fetched() == []
    assert not (cache / "models--org--tiny" / "blobs").exists()


# ---- an interrupted download resumes ---------------------------------------------------------------------------


def test_a_download_cut_mid_file_resumes_with_a_range_request(hub, cache, tiny, monkeypatch):
    chunk = 1 << 20
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", chunk)  # what huggingface_hub writes at a time
    served = folder_files(tiny)
    cut = 3 * chunk
    assert len(served["model.safetensors"]) > cut + chunk
    hub.add("org/tiny", served, cut={"model.safetensors": cut})
    res = download("org/tiny", "--download-dir", str(cache))
    assert res.exit_code == 0, res.output
    gets = [(r.range, r.status) for r in hub.file_requests("GET") if r.file == "model.safetensors"]
    assert gets == [(None, 200), (f"bytes={cut}-", 206)]
    snapshot = Path(res.stdout.strip())
    data = (snapshot / "model.safetensors").read_bytes()
    assert hashlib.sha256(data).digest() == hashlib.sha256(served["model.safetensors"]).digest()
    assert not list(cache.rglob("*.incomplete"))


# ---- GGUF: one file of the repo ----------------------------------------------------------------------------------

GGUF = {"tiny.Q4_K_M.gguf": b"GGUF" + b"\4" * 2048, "tiny.Q8_0.gguf": b"GGUF" + b"\x08" * 4096,
        "README.md": b"# tiny GGUF\n"}


@pytest.mark.parametrize("args, name", [(["org/tiny-GGUF:Q8_0"], "tiny.Q8_0.gguf"),
                                        (["org/tiny-GGUF:q4_k_m"], "tiny.Q4_K_M.gguf"),
                                        (["org/tiny-GGUF", "--gguf-file", "tiny.Q4_K_M.gguf"], "tiny.Q4_K_M.gguf")],
                         ids=["quant", "quant-lowercase", "gguf-file"])
def test_a_gguf_quant_downloads_only_that_file(hub, cache, args, name):
    repo = hub.add("org/tiny-GGUF", GGUF)
    res = download(*args, "--download-dir", str(cache))
    assert res.exit_code == 0, res.output
    path = Path(res.stdout.strip())
    assert path == cache / "models--org--tiny-GGUF" / "snapshots" / repo.revisions["main"] / name
    assert path.read_bytes() == GGUF[name]
    assert hub.fetched() == [name]


@pytest.mark.parametrize("model, message", [
    ("org/tiny-GGUF:Q5_K_M", "error: 'org/tiny-GGUF' has no GGUF file matching 'Q5_K_M' (it has Q4_K_M, Q8_0)"),
    ("org/tiny-GGUF", "error: 'org/tiny-GGUF' holds GGUF files only: pick one with --gguf-file NAME or "
                      "org/tiny-GGUF:QUANT (it has Q4_K_M, Q8_0)")], ids=["unknown-quant", "no-quant"])
def test_a_gguf_repo_without_a_matching_quant_lists_the_quants(hub, cache, model, message):
    hub.add("org/tiny-GGUF", GGUF)
    assert error_line(download(model, "--download-dir", str(cache))) == message
    assert hub.fetched() == []


# ---- the stand-in itself: paged tree listings, LFS served without the CDN, HF_ENDPOINT in a subprocess -----------


def test_paged_tree_listings_and_lfs_files_served_from_resolve(hub, cache):
    files = {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors": b"\0" * 4096, **NOT_SERVED}
    hub.add("org/dummy", files)
    hub.page_size, hub.lfs_cdn = 2, False
    res = download("org/dummy", "--download-dir", str(cache))
    assert res.exit_code == 0, res.output
    assert snapshot_files(Path(res.stdout.strip())) == {n: files[n] for n in ("config.json", "tokenizer.json",
                                                                              "model.safetensors")}
    trees = [r for r in hub.requests if "/tree/" in r.path]
    assert len(trees) > 2 and "cursor=" in trees[-1].path  # several pages, followed through the Link header
    assert not any(r.cdn for r in hub.requests)
    blob = cache / "models--org--dummy" / "blobs" / hashlib.sha256(files["model.safetensors"]).hexdigest()
    assert blob.read_bytes() == files["model.safetensors"]


def test_vserve_download_in_a_subprocess_reaches_the_hub_through_hf_endpoint(hub, cache):
    repo = hub.add("org/tiny-GGUF", GGUF)
    env = {**hub.env(), "VSERVE_NO_PROGRESS": "1", "HF_HOME": str(cache.parent / "hf-home")}
    res = subprocess.run([sys.executable, "-m", "vserve.cli.main", "download", "org/tiny-GGUF:Q8_0",
                          "--download-dir", str(cache)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [str(cache / "models--org--tiny-GGUF" / "snapshots" / repo.revisions["main"] /
                                           "tiny.Q8_0.gguf")]
    assert hub.fetched() == ["tiny.Q8_0.gguf"]
    res = subprocess.run([sys.executable, "-m", "vserve.cli.main", "download", "org/missing"], capture_output=True,
                         text=True, env=env)  # into $HF_HOME/hub
    assert res.returncode == 2
    assert res.stderr.splitlines() == ["error: model 'org/missing' is neither a local path nor a repo on the Hugging "
                                       "Face hub; check the id (org/name)"]


def test_doctor_plans_a_hub_id_from_its_config_and_says_what_would_download(hub, cache, tiny, monkeypatch):
    """Only config.json is fetched; the download check sizes the rest from the hub's file metadata."""
    from test_doctor import HEALTHY

    from vserve.ops import probe

    hub.add("org/tiny", {**folder_files(tiny), **NOT_SERVED})
    monkeypatch.setattr(probe, "probe_environment", lambda: HEALTHY)
    res = runner.invoke(app, ["doctor", "org/tiny", "--download-dir", str(cache), "--json"],
                        env={"VSERVE_NO_PROGRESS": "1"})
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["plan"]["verdict"] == "fits"
    assert hub.fetched() == ["config.json"]
    check = next(c for c in out["checks"] if c["name"] == "download")
    assert check["status"] == "ok" and f"into {cache}" in check["finding"]
    monkeypatch.setattr(vhub, "free_bytes", lambda path: 1000)
    res = runner.invoke(app, ["doctor", "org/tiny", "--download-dir", str(cache), "--json"],
                        env={"VSERVE_NO_PROGRESS": "1"})
    check = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "download")
    assert (res.exit_code, check["status"]) == (1, "fail")
    assert check["finding"].endswith(", 0.0 MiB free") and "--download-dir" in check["fix"]
