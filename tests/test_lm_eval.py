"""EleutherAI's lm-evaluation-harness scores a multiple-choice task through `vserve serve` (model type
`local-completions`: echo + logprobs on /v1/completions) as its own `hf` backend scores it on the same weights
(the embedded SmolLM2, float32, CPU). The task and its data are written here: nothing is downloaded."""

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")

ITEMS = [
    {"question": "The capital of France is", "choices": [" Paris", " London", " Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" five", " four", " seven", " ten"], "answer": 1},
    {"question": "The colour of a clear daytime sky is", "choices": [" green", " red", " blue"], "answer": 2},
    {"question": "Ice is water that has", "choices": [" frozen", " boiled", " evaporated and flown away"],
     "answer": 0},
    {"question": "A cat says", "choices": [" woof", " meow", " moo"], "answer": 1},
]

TASK_YAML = """task: vserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_task")
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in ITEMS))
    (d / "vserve_mc.yaml").write_text(TASK_YAML.format(data=data))
    return d


def evaluate(task_dir, model: str, model_args: dict) -> tuple[float, list[list[float]]]:
    """(accuracy, each item's per-choice log-likelihoods)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=["vserve_mc"],
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True, batch_size=1)
    samples = sorted(out["samples"]["vserve_mc"], key=lambda s: s["doc_id"])
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return out["results"]["vserve_mc"]["acc,none"], lls


def test_lm_eval_local_completions_equals_hf_backend(server_factory, default_model_dir, task_dir, tmp_path,
                                                     monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    server = server_factory([str(default_model_dir), "--served-model-name", "smol", "--dtype", "float32",
                             "--device", "cpu", "--max-model-len", "512"], tmp_path / "server.log")
    acc, lls = evaluate(task_dir, "local-completions", {
        "model": "smol", "base_url": server.url + "/v1/completions", "tokenizer": str(default_model_dir),
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1})
    ref_acc, ref_lls = evaluate(task_dir, "hf", {"pretrained": str(default_model_dir), "dtype": "float32",
                                                 "device": "cpu"})
    assert len(lls) == len(ITEMS) and [len(x) for x in lls] == [len(x["choices"]) for x in ITEMS]
    assert acc == ref_acc
    for i, (got, ref) in enumerate(zip(lls, ref_lls)):
        assert got == pytest.approx(ref, abs=0.02), f"item {i}: {got} vs the hf backend's {ref}"
