"""`vserve serve`: a real server process on loopback, driven by the official openai SDK and raw HTTP."""

import asyncio
import json

import httpx
import openai
import pytest

from vserve import LLM, SamplingParams

MODEL = "tiny"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(server_factory, tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    return server_factory([str(tiny_dir), "--served-model-name", MODEL, "--dtype", "float32",
                           "--device", "cpu", "--max-model-len", "512"], log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=512)


def n_tokens(server, text: str) -> int:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["count"]


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_plain_equals_offline_chat(client, offline):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=12))[0]
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_concatenates_to_plain(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=16)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_n2_and_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, temperature=1.0, seed=5, max_tokens=8,
                                          logprobs=True, top_logprobs=3)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    for c in resp.choices:
        assert len(c.logprobs.content) == resp.usage.completion_tokens // 2 or c.finish_reason == "stop"
        for entry in c.logprobs.content:
            assert entry.logprob <= 0
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)


def test_greedy_top_logprob_is_the_token(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6,
                                          logprobs=True, top_logprobs=1)
    for entry in resp.choices[0].logprobs.content:
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_completion_plain_list_echo_and_usage(client, server):
    prompts = ["Hello there", "The weather today"]
    resp = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=5)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.prompt_tokens == sum(n_tokens(server, p) for p in prompts)
    echo = client.completions.create(model=MODEL, prompt=prompts[0], temperature=0, max_tokens=5, echo=True)
    assert echo.choices[0].text == prompts[0] + resp.choices[0].text
    assert resp.usage.completion_tokens == 10 or any(c.finish_reason == "stop" for c in resp.choices)


def test_cache_salt_keeps_cached_prefixes_per_tenant(client, server):
    """vLLM's cache_salt request field, through the engine process: the same prompt hits the prefix cache under
    the same salt only; usage.prompt_tokens_details.cached_tokens says how many prompt tokens it reused."""
    prompt = list(range(100, 100 + 3 * 16 + 5))  # 3 full blocks and a tail

    def cached(salt=None, route="completions"):
        extra = {} if salt is None else {"cache_salt": salt}
        if route == "chat":
            resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi " * 40}],
                                                  max_tokens=2, extra_body=extra)
        else:
            resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert [cached("tenant-a"), cached("tenant-b"), cached(None), cached("tenant-b")] == [48, 0, 0, 48]
    assert cached("chat-a", "chat") == 0 and cached("chat-a", "chat") > 0 and cached("chat-b", "chat") == 0
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_completion_token_ids_prompt_and_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], temperature=0, max_tokens=4, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert "".join(lp.tokens) == resp.choices[0].text or resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == 4


def test_completion_stream(client):
    plain = client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=10)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=10,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_sse_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    json.loads(lines[0][len("data: "):])


def test_tokenize_detokenize_roundtrip(server):
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def test_version_and_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_tokens": 600}, "512"),
])
def test_completion_bad_values_are_400(server, body, needle):
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"]


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": "hi"},
    {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30, "logprobs": True},
])
def test_chat_bad_values_are_400(server, body):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400


def test_unknown_model_and_route_are_404(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_oversized_body_is_413(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()


def test_not_json_is_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_concurrent_streams_with_disconnects(server, offline):
    """64 concurrent streams, every 4th dropped mid-stream: the rest equal their solo greedy output."""
    prompts = [f"Request number {i} says" for i in range(64)]
    expected = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]

    async def one(i, http):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 24, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text = ""
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                n += 1
                if i % 4 == 0 and n == 3:
                    return None  # leave mid-stream: the server must abort and free the request
                text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*[one(i, http) for i in range(64)])

    got = asyncio.run(main())
    for i, text in enumerate(got):
        if i % 4:
            assert text == expected[i], f"request {i}"
    # aborted requests are freed: nothing running or waiting, no KV block held
    for _ in range(50):
        m = httpx.get(server.url + "/metrics").text
        if _metric(m, "vserve:num_requests_running") == 0 and _metric(m, "vserve:kv_cache_usage_perc") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert _metric(m, "vserve:num_requests_running") == 0
    assert _metric(m, "vserve:num_requests_waiting") == 0
    assert _metric(m, "vserve:kv_cache_usage_perc") == 0
    assert _metric(m, "vserve:generation_tokens_total") > 0
    for name in ("vserve:time_to_first_token_seconds_count", "vserve:e2e_request_latency_seconds_count",
                 "vserve:prompt_tokens_total", "vserve:prefix_cache_queries_total",
                 "vserve:request_queue_time_seconds_count", "vserve:iteration_tokens_total_count"):
        assert _metric(m, name) > 0, name


def test_api_key_guards_v1_and_tokenize(server_factory, tiny_dir, tmp_path):
    s = server_factory([str(tiny_dir), "--served-model-name", MODEL, "--api-key", "s3cret", "--max-model-len", "256"],
                       tmp_path / "keyed.log")
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x"}),
                               ("POST", "/v1/chat/completions", {"messages": CHAT}),
                               ("POST", "/v1/embeddings", {"input": "x"}), ("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [1]})]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, s.url + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(s.url + "/health").status_code == 200
    assert httpx.get(s.url + "/metrics").status_code == 200
    ok = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
    assert ok.models.list().data[0].id == MODEL
    assert "http://127.0.0.1:" in s.output()
