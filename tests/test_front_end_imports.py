"""The front end starts without torch (issue #24, start-up): the API process and an offline front end whose core runs
in an engine process import only the torch-free side of the engine (core/messages.py, core/model_config.py), and load
a generic fast tokenizer without AutoTokenizer's imports, with the same tokenizer AutoTokenizer gives."""

import json
import shutil
import subprocess
import sys

import pytest

from vserve.core.config import EngineConfig
from vserve.core.core_client import use_engine_process
from vserve.core.processor import (
    GENERIC_TOKENIZER_MODEL_TYPES,
    QWEN_MODEL_TYPES,
    direct_tokenizer_class,
    load_tokenizer,
)

FRONT_END = """
import json, sys
from vserve.core.config import EngineConfig
from vserve.core.processor import InputProcessor
import vserve.cli.main, vserve.core.async_engine, vserve.core.engine, vserve.core.llm, vserve.core.server.app
import vserve.core.server.launch as launch
from vserve import LLM, SamplingParams

p = InputProcessor.from_config(EngineConfig(model=sys.argv[1]))
ids = p.tokenize("The capital of France is")
embedding = launch._is_embedding(sys.argv[1])
print(json.dumps({"torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
                  "tokenizer": type(p.tokenizer).__name__, "ids": ids, "embedding": embedding}))
"""


def test_the_front_end_imports_no_torch(default_model_dir):
    """What the API process runs before the engine process is ready (CLI, server app, launch, InputProcessor with
    its tokenizer, LLM's module) leaves torch unimported: its import is the engine process's alone."""
    out = subprocess.run([sys.executable, "-c", FRONT_END, str(default_model_dir)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] == []
    assert got["tokenizer"] == "TokenizersBackend" and not got["embedding"]
    from transformers import AutoTokenizer

    assert got["ids"] == AutoTokenizer.from_pretrained(str(default_model_dir))("The capital of France is").input_ids


def _tokenizer_folder(tmp_path, src, model_type: str | None, tokenizer_class: str, auto_map: bool = False):
    d = tmp_path / f"{model_type}-{tokenizer_class}-{auto_map}"
    d.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, d / name)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = tokenizer_class
    if auto_map:
        cfg["auto_map"] = {"AutoTokenizer": [None, "tok.MyTokenizer"]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if model_type is not None:
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "PreTrainedTokenizerFast", "Qwen2Tokenizer",
                                             "Qwen2TokenizerFast"])
def test_the_direct_tokenizer_is_the_one_autotokenizer_loads(tmp_path, default_model_dir, tokenizer_class):
    """For every model type vserve serves (and a folder without config.json), a folder naming a generic class, and a
    Qwen folder naming Qwen2's, loads through the direct path to the class AutoTokenizer picks, with the same ids,
    special tokens and chat template output."""
    from transformers import AutoTokenizer

    text = "Hello <|im_start|> world, ünïcode 12345!\n  two  spaces"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    qwen = tokenizer_class.startswith("Qwen2")
    for model_type in [*sorted(QWEN_MODEL_TYPES if qwen else GENERIC_TOKENIZER_MODEL_TYPES | {"qwen2"}), None]:
        d = _tokenizer_folder(tmp_path, default_model_dir, model_type, tokenizer_class)
        assert direct_tokenizer_class(d) is not None, model_type
        fast, auto = load_tokenizer(d, "safetensors", False), AutoTokenizer.from_pretrained(str(d))
        assert type(fast) is type(auto), model_type
        assert fast(text).input_ids == auto(text).input_ids, model_type
        assert (fast.bos_token_id, fast.eos_token_id, fast.all_special_ids) == (
            auto.bos_token_id, auto.eos_token_id, auto.all_special_ids), model_type
        assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), model_type


def test_folders_the_direct_path_cannot_vouch_for_go_through_autotokenizer(tmp_path, default_model_dir):
    named = _tokenizer_folder(tmp_path, default_model_dir, "llama", "GPT2Tokenizer")
    assert direct_tokenizer_class(named) is None
    assert direct_tokenizer_class(_tokenizer_folder(tmp_path, default_model_dir, "llama", "TokenizersBackend",
                                                    auto_map=True)) is None
    assert direct_tokenizer_class(_tokenizer_folder(tmp_path, default_model_dir, "internlm2",
                                                    "TokenizersBackend")) is None  # a type vserve does not serve
    # AutoTokenizer loads TokenizersBackend for a Mistral folder naming Qwen2Tokenizer: not vouched for here
    assert direct_tokenizer_class(_tokenizer_folder(tmp_path, default_model_dir, "mistral", "Qwen2Tokenizer")) is None
    no_json = _tokenizer_folder(tmp_path, default_model_dir, "llama", "PreTrainedTokenizerFast")
    (no_json / "tokenizer.json").unlink()
    assert direct_tokenizer_class(no_json) is None
    # the AutoTokenizer route still loads a named class (GPT2Tokenizer from the same tokenizer.json)
    assert type(load_tokenizer(named, "safetensors", False)).__name__ == "GPT2Tokenizer"


def test_an_offline_front_end_spawns_its_core_where_a_gpu_is_visible(monkeypatch):
    """The transport is chosen without importing torch: as asked, the server always, offline on a visible GPU."""
    assert use_engine_process(EngineConfig(), serving=True)
    assert not use_engine_process(EngineConfig(device="cpu"), serving=False)
    assert use_engine_process(EngineConfig(device="cuda"), serving=False)
    assert not use_engine_process(EngineConfig(device="cuda", engine_process=False), serving=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not use_engine_process(EngineConfig(device="auto"), serving=False)


def test_a_started_engine_freezes_the_start_up_heap_and_relaxes_young_collections(default_model_dir):
    """After start-up the front end's process (here with the core in it) holds its start-up objects out of the
    collector's scans and collects the young generation every GC_THRESHOLD_0 allocations (core_client.tune_gc)."""
    code = ("import gc, sys\nfrom vserve import LLM\nbefore = gc.get_threshold()[0]\n"
            "llm = LLM(model=sys.argv[1], max_model_len=256)\n"
            "print(before, gc.get_threshold()[0], gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code, str(default_model_dir)], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    before, after, frozen = map(int, out.stdout.split()[-3:])
    from vserve.core.core_client import GC_THRESHOLD_0

    assert before < GC_THRESHOLD_0 <= after and frozen > 10_000
