"""Tensor parallelism on CPU (gloo): TP=2 greedy tokens equal TP=1's and HF's; a dead rank is named, fast."""

import random
import time

import pytest
import torch.distributed as dist

from vserve import LLM, SamplingParams

NEW_TOKENS = 24
CASES = {
    "llama-gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    # one KV head for two ranks (replicated), q/k/v bias sharded, tied vocab-parallel embedding as LM head
    "qwen2-mqa-bias-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 21, 70)]


def _greedy(folder, **engine_args) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", device="cpu", skip_tokenizer_init=True, **engine_args)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_greedy_tokens_equal_tp1_and_hf(tiny_model, case, hf_greedy):

    arch, overrides = CASES[case]
    folder = tiny_model(arch, **overrides)
    tp1 = _greedy(folder)
    assert not dist.is_initialized()  # one process never starts torch.distributed
    assert _greedy(folder, tensor_parallel_size=2, max_num_batched_tokens=32) == tp1  # chunked prefill too
    # the engine process starts the other rank and feeds it through shared memory, as `serve` and GPUs run it
    assert _greedy(folder, tensor_parallel_size=2, engine_process=True) == tp1
    assert tp1 == hf_greedy(folder, _prompts(), NEW_TOKENS)
    assert not dist.is_initialized()  # shut down cleanly: the next engine may start its own group


def test_killed_rank_is_named_within_bounded_time(tiny_model, monkeypatch):
    monkeypatch.setenv("VSERVE_DIST_TIMEOUT", "20")
    llm = LLM(str(tiny_model("llama")), dtype="float32", device="cpu", skip_tokenizer_init=True,
              tensor_parallel_size=2)
    proc = llm.llm_engine.core.workers.procs[1]
    proc.kill()
    proc.wait(10)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker died: rank 1 \(exit code -9\)"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 25
    assert llm.llm_engine.core.workers is None and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="rank 1"):  # the engine stays dead: its shards are gone
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)


def test_killed_rank_of_the_engine_process_fails_the_request_with_its_name(tiny_model, monkeypatch):
    import os
    import signal
    import subprocess

    monkeypatch.setenv("VSERVE_DIST_TIMEOUT", "20")
    llm = LLM(str(tiny_model("llama")), dtype="float32", device="cpu", skip_tokenizer_init=True,
              tensor_parallel_size=2, engine_process=True)
    try:
        engine = llm.llm_engine.client.pid
        kids = subprocess.run(["pgrep", "-P", str(engine)], capture_output=True, text=True).stdout.split()
        ranks = [int(k) for k in kids if b"vserve.core.worker" in open(f"/proc/{k}/cmdline", "rb").read()]
        assert len(ranks) == 1  # the engine process started rank 1 itself
        os.kill(ranks[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker died: rank 1 \(exit code -9\)"):
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_tp_size_must_divide_the_heads(tiny_model):
    with pytest.raises(ValueError, match=r"--tensor-parallel-size must divide the model's 4 attention heads, got 3"):
        LLM(str(tiny_model("llama")), dtype="float32", device="cpu", skip_tokenizer_init=True,
            tensor_parallel_size=3)


def test_pp2_and_tp2_pp2_greedy_tokens_equal_tp1(tiny_model):
    folder = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    tp1 = _greedy(folder)
    assert _greedy(folder, pipeline_parallel_size=2) == tp1  # layers split 2 + 1
    assert _greedy(folder, tensor_parallel_size=2, pipeline_parallel_size=2, max_num_batched_tokens=32) == tp1


def test_two_node_launch_on_loopback_gives_the_same_tokens(tiny_model, tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import free_port

    folder = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    port = free_port()
    common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port), "--device", "cpu"]
    # node 1 runs its rank only: `vserve serve MODEL --node-rank 1` starts no server
    node1 = subprocess.Popen([sys.executable, "-m", "vserve.cli.main", "serve", str(folder), "--node-rank", "1",
                              *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, "VSERVE_DIST_TIMEOUT": "60"})
    try:
        got = _greedy(folder, tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port)
        out, _ = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node1.returncode == 0, out.decode(errors="replace")
    assert got == _greedy(folder)


def test_killing_node_0_makes_the_other_node_exit_nonzero(tiny_model, tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import _start_server, free_port

    folder = str(tiny_model("llama"))
    common = ["-tp", "2", "--nnodes", "2", "--master-port", str(free_port()), "--device", "cpu",
              "--skip-tokenizer-init"]
    node1 = subprocess.Popen([sys.executable, "-m", "vserve.cli.main", "serve", folder, "--node-rank", "1", *common],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "VSERVE_DIST_TIMEOUT": "30"})
    try:
        server = _start_server([folder, "--node-rank", "0", *common], tmp_path / "node0.log", timeout=90)
        server.proc.kill()
        server.proc.wait()
        start = time.monotonic()
        code = node1.wait(timeout=40)
        assert code != 0 and time.monotonic() - start < 40
    finally:
        node1.kill()
