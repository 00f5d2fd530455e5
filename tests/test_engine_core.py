"""`vserve serve` with the engine in its own process (the default) against `--no-engine-process` (the loop on a
thread): the same outputs, aborts that free the engine process's KV blocks, and a killed engine process."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model("llama")


def _args(tiny_dir) -> list[str]:
    return [str(tiny_dir), "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
            "--max-model-len", "512"]


@pytest.fixture(scope="module")
def servers(server_factory, tiny_dir, tmp_path_factory):
    """(engine-process server, thread server)."""
    logs = tmp_path_factory.mktemp("logs")
    return (server_factory(_args(tiny_dir), logs / "process.log"),
            server_factory(_args(tiny_dir) + ["--no-engine-process"], logs / "thread.log"))


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def same(a, b) -> bool:
    """Equal, floats (logprobs) within 1e-4: the engine process runs torch on fewer CPU threads, which changes
    the order of float sums, never the greedy tokens."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def _post(server, route: str, body: dict):
    """The response body without the parts that differ by run (ids, timestamps); SSE streams as the list of
    their events, texts and token logprobs joined per choice (how they split into chunks depends on timing)."""
    if not body.get("stream"):
        r = httpx.post(server.url + route, json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        return {k: v for k, v in out.items() if k not in ("id", "created")}
    joined: dict = {}
    with httpx.stream("POST", server.url + route, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                joined["usage"] = chunk["usage"]
            for c in chunk["choices"]:
                j = joined.setdefault(c["index"], {"text": "", "logprobs": [], "finish_reasons": []})
                j["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                j["logprobs"] += ((c.get("logprobs") or {}).get("content") or [])
                j["finish_reasons"] += [c["finish_reason"]] if c["finish_reason"] else []
    return joined


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": ["Hello there", "The weather today"], "temperature": 0, "max_tokens": 12,
                         "logprobs": 2}),
    ("/v1/completions", {"prompt": "Once upon", "temperature": 0, "max_tokens": 16, "stream": True}),
    ("/v1/completions", {"prompt": ["Hello there", "The weather today"], "temperature": 0, "max_tokens": 12,
                         "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": [5, 6, 7], "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 10}),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 12}),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 12, "stream": True,
                              "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 10,
                              "stream": True}),
])
def test_engine_process_answers_as_the_thread_does(servers, route, body):
    proc, thread = servers
    got, want = _post(proc, route, body), _post(thread, route, body)
    assert same(got, want), (got, want)
    if "choices" in got:
        texts = [c.get("text") or c["message"]["content"] for c in got["choices"]]
    else:
        texts = [c["text"] for k, c in got.items() if k != "usage"]
        assert all(len(c["finish_reasons"]) == 1 for k, c in got.items() if k != "usage")
    assert all(texts)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_same(servers, stream):
    """A stop string from the middle of the greedy text (held back while streaming, then cut)."""
    proc, thread = servers
    body = {"prompt": "Once upon", "temperature": 0, "max_tokens": 16}
    text = _post(thread, "/v1/completions", body)["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    body = {**body, "stop": [stop], "stream": stream}
    got, want = _post(proc, "/v1/completions", body), _post(thread, "/v1/completions", body)
    assert same(got, want), (got, want)
    cut = got["choices"][0] if not stream else got[0]
    reason = cut["finish_reason"] if not stream else cut["finish_reasons"][0]
    assert reason == "stop" and stop not in cut["text"] and text.startswith(cut["text"])


def test_disconnect_frees_the_engine_process_kv_blocks(servers):
    proc, _ = servers

    async def main():
        body = {"prompt": "A long story", "max_tokens": 300, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", proc.url + "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n == 3:
                        break
                return (await http.get(proc.url + "/metrics")).text

    during = asyncio.run(main())  # the stream is closed here: the server aborts it in the engine process
    assert _metric(during, "vserve:num_requests_running") == 1
    assert _metric(during, "vserve:kv_cache_usage_perc") > 0
    for _ in range(50):
        after = httpx.get(proc.url + "/metrics").text
        if _metric(after, "vserve:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert _metric(after, "vserve:kv_cache_usage_perc") == 0
    assert _metric(after, "vserve:num_requests_running") == 0
    assert _metric(after, "vserve:generation_tokens_total") >= 3


def test_killed_engine_process_fails_requests_with_503(servers):
    """Last in this module: it takes the engine-process server down."""
    proc, _ = servers
    pid = proc.engine_pid()

    async def main():
        long = {"prompt": "Tell a long story", "max_tokens": 400, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60) as http:
            plain = asyncio.ensure_future(http.post(proc.url + "/v1/completions", json=long))
            events = []
            async with http.stream("POST", proc.url + "/v1/completions", json={**long, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:
                            os.kill(pid, signal.SIGKILL)
            return await plain, events

    t0 = time.monotonic()
    plain, events = asyncio.run(main())
    assert time.monotonic() - t0 < 30
    assert plain.status_code == 503
    assert "engine process died" in plain.json()["error"]["message"]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and "engine process died" in err["message"]
    try:
        r = httpx.post(proc.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503
    except httpx.ConnectError:
        pass  # the server already went down
    assert proc.proc.wait(30) == 1
    assert "the engine process died (exit code -9)" in proc.output()


def test_engine_process_start_up_error_is_one_line_exit_2(tiny_dir):
    """A bad-input error raised while the engine process builds the engine reads as it does in-process."""
    r = subprocess.run([sys.executable, "-m", "vserve.cli.main", "serve", *_args(tiny_dir), "--num-kv-blocks", "1",
                        "--port", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: the KV cache holds 1 blocks of 16 tokens")
    assert "Traceback" not in r.stderr + r.stdout


class _RecordingCore:
    """What CoreLoop calls on an EngineCore, in order; it never has work, so one pass ends in a stats message."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add_request(self, req) -> None:
        self.calls.append(("add", req.request_id))

    def abort_requests(self, request_ids) -> None:
        self.calls.append(("abort", tuple(request_ids)))

    def has_work(self) -> bool:
        return False

    def core_stats(self, seconds: float) -> str:
        return "stats"


def test_an_abort_and_a_new_request_reusing_its_id_in_one_pass_keep_their_order():
    """Both transports run CoreLoop: a client that aborts request "x" and at once sends a new "x" must get the
    new one served (it used to be dropped with the old one when both landed in the same pass)."""
    from vserve.core.core_client import CoreLoop
    from vserve.core.messages import encode_request
    from vserve.core.request import Request
    from vserve.core.sampling_params import SamplingParams

    core = _RecordingCore()
    loop = CoreLoop(core)
    old, new = (Request(request_id="x", prompt_token_ids=[1, 2], sampling_params=SamplingParams(), max_tokens=4,
                        parent_id="x", arrival_time=t) for t in (1.0, 2.0))
    loop.put(("add", [encode_request(old)]))
    loop.put(("abort", ["x"]))
    loop.put(("add", [encode_request(new)]))
    assert loop.next_message(block=False) == ("stats", "stats")
    assert core.calls == [("add", "x"), ("abort", ("x",)), ("add", "x")]
    assert loop.next_message(block=False) is None  # nothing left to do


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_stream_hands_over_only_what_is_new(tiny_dir, kind):
    """Deltas end to end: each streamed output holds only the tokens, text and logprobs new since the one before,
    so the work a stream does is linear in its length (the chunks' token counts add up to the output's, where
    cumulative outputs would add up to its square); a non-streaming request gets the same output, built once."""
    from vserve.core.async_engine import AsyncLLM
    from vserve.core.config import EngineConfig
    from vserve.core.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_dir), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=64,
                          engine_process=kind == "process")
    client = AsyncLLM(config)
    client.start()
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, logprobs=2, n=2)

    async def run():
        chunks = [out async for out in client.generate("s", [5, 6, 7, 8], params, stream=True)]
        final = [out async for out in client.generate("f", [5, 6, 7, 8], params, stream=False)]
        return chunks, final

    try:
        chunks, final = asyncio.run(run())
    finally:
        client.shutdown()
    assert len(final) == 1 and final[0].finished and chunks[-1].finished
    assert len(chunks) > 10  # streamed step by step, not at the end
    for i in range(2):
        comps = [c for out in chunks for c in out.outputs if c.index == i]
        whole = final[0].outputs[i]
        assert sum(len(c.token_ids) for c in comps) == len(whole.token_ids) == 120
        assert [t for c in comps for t in c.token_ids] == whole.token_ids
        assert "".join(c.text for c in comps) == whole.text
        assert [lp for c in comps for lp in c.logprobs] == whole.logprobs
        assert abs(sum(c.cumulative_logprob for c in comps) - whole.cumulative_logprob) < 1e-4
        assert comps[-1].finish_reason == whole.finish_reason == "length"


def test_deltas_a_consumer_fell_behind_on_are_merged_in_order():
    from vserve.core.async_engine import merge_deltas
    from vserve.core.request import CompletionOutput, RequestOutput

    def delta(text, ids, finish=None):
        return RequestOutput("r", "p", [1], [CompletionOutput(0, text, ids, -0.5 * len(ids), [{t: None} for t in ids],
                                                              finish)], finish is not None)

    merged = merge_deltas(merge_deltas(delta("a", [1]), delta("", [2])), delta("bc", [3, 4], "stop"))
    c = merged.outputs[0]
    assert (c.text, c.token_ids, c.cumulative_logprob, c.finish_reason, merged.finished) == \
        ("abc", [1, 2, 3, 4], -2.0, "stop", True)
    assert c.logprobs == [{1: None}, {2: None}, {3: None}, {4: None}]


def test_step_outputs_send_a_plain_row_as_its_token_alone(tiny_dir):
    """The core's per-step message is columns (request ids, tokens); a row carries a CoreOutput only for its first
    token (cache hits), logprobs, or its finish. Every token arrives once, in order, and the front end rebuilds
    the same outputs from them (the parity tests above cover the texts)."""
    import pickle

    from vserve.core.config import EngineConfig
    from vserve.core.engine_core import EngineCore
    from vserve.core.messages import CoreOutput, StepOutputs
    from vserve.core.request import Request
    from vserve.core.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=str(tiny_dir), dtype="float32", device="cpu", max_model_len=512,
                                   num_kv_blocks=64, async_scheduling=True))
    plain, with_lp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), \
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for rid, sp in (("a", plain), ("b", with_lp)):
        core.add_request(Request(rid, [5, 6, 7, 8], sp, sp.max_tokens))
    rows: dict[str, list] = {"a": [], "b": []}
    while core.has_work():
        outs = pickle.loads(pickle.dumps(core.step()))  # as the engine process sends it
        assert isinstance(outs, StepOutputs) and len(outs.request_ids) == len(outs.token_ids) == len(outs)
        for i, (rid, token) in enumerate(zip(outs.request_ids, outs.token_ids)):
            full = outs.full.get(i)
            assert full is None or (full.request_id, full.token_id) == (rid, token)
            rows[rid].append(full)
    a, b = rows["a"], rows["b"]
    assert len(a) == 9 and len(b) == 6
    assert isinstance(a[0], CoreOutput) and a[0].num_cached_tokens == 0  # the first token
    assert all(r is None for r in a[1:-1])  # the plain rows: a token and nothing else
    assert a[-1].finish_reason == "length" and b[-1].finish_reason == "length"
    assert all(r is not None and r.logprobs is not None for r in b)  # every logprobs row is full

    early = StepOutputs(["x"], [1], {})
    early.add_full(CoreOutput("y", 2, None, "stop", None, 0, 1.0, 1.0))
    later = StepOutputs(["z"], [3], {})
    later.add_full(CoreOutput("w", 4, None, None, None, 3, None, None))
    both = early.extend(later)
    assert (both.request_ids, both.token_ids) == (["x", "y", "z", "w"], [1, 2, 3, 4])
    assert sorted(both.full) == [1, 3] and both.full[3].request_id == "w"
