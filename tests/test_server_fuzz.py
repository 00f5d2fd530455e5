"""Fuzz: malformed and hostile requests get a 4xx with OpenAI's error body, never a 5xx; the server lives on."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/embeddings": {"input": "Hi"},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                      st.text(max_size=30))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
hostile = st.one_of(json_value, st.sampled_from([
    -1, 0, 10**12, -(10**12), 1e308, -1e308, "", "a" * 5000, [], [[]], [-1], [10**9], {"": None},
    [{"role": "user"}], [{"role": "user", "content": None}], [{"role": "tool", "content": "x"}],
    {"type": "json_object"}, ["\udcff"], "\u0000", [[1, 2], "mixed"], {"1": "x"}, {"999999999": 5},
]))


def _assert_client_error(r: httpx.Response, allow_ok: bool = True) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    else:
        assert allow_ok, r.text


def _post(http, route, body):
    # ensure_ascii: lone surrogates travel as \\udXXXX escapes, valid JSON the server must cope with
    return http.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def server(server_factory, tiny_model, tmp_path_factory):
    return server_factory([str(tiny_model("llama")), "--served-model-name", "tiny", "--max-model-len", "256"],
                          tmp_path_factory.mktemp("fuzz") / "server.log")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
@given(route=st.sampled_from(sorted(ROUTES)), field=st.text(max_size=12) | st.sampled_from(
    ["prompt", "messages", "max_tokens", "n", "temperature", "top_p", "top_k", "logprobs", "top_logprobs",
     "stop", "seed", "logit_bias", "stream", "stream_options", "echo", "best_of", "input", "tokens", "model",
     "encoding_format", "min_tokens", "stop_token_ids", "response_format", "max_completion_tokens",
     "presence_penalty", "repetition_penalty", "min_p", "suffix", "dimensions", "messages"]),
       value=hostile, drop=st.booleans())
def test_mutated_bodies_never_5xx(http, route, field, value, drop):
    body = dict(ROUTES[route])
    if drop and field in body:
        del body[field]
    else:
        body[field] = value
    # keep accepted requests cheap: the fuzz is about validation, not generation length
    if route.startswith("/v1/c") and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8
    if isinstance(body.get("max_completion_tokens"), int) and body["max_completion_tokens"] > 8:
        body["max_completion_tokens"] = 8
    if route == "/v1/chat/completions" and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = body["n"] % 97 + 33 if body["n"] > 32 else 4  # either refused (> 32) or cheap
    _assert_client_error(_post(http, route, body))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(sorted(ROUTES)), body=json_value)
def test_arbitrary_json_never_5xx(http, route, body):
    if isinstance(body, dict) and "max_tokens" not in body:
        body["max_tokens"] = 2
    _assert_client_error(_post(http, route, body))


RAW = [
    b"", b"{", b"null", b"[]", b'"string"', b"123", b"\xff\xfe\x00", b'{"prompt": "x"' + b" " * 10,
    b"[" * 5000 + b"]" * 5000, b'{"prompt": "\\ud800"}', b'{"prompt": "x", "prompt": 5}',
]


@pytest.mark.parametrize("payload", RAW)
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_raw_garbage_is_4xx(http, route, payload):
    r = http.post(route, content=payload, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "error" in r.json()


def test_wrong_methods_and_content_types(http):
    for route in ROUTES:
        r = http.get(route)
        assert r.status_code in (404, 405) and "error" in r.json()
        r = http.post(route, content=b"prompt=x", headers={"content-type": "application/x-www-form-urlencoded"})
        assert 400 <= r.status_code < 500 and "error" in r.json()


def test_server_still_answers_after_fuzz(http):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 3
    r = http.get("/metrics")
    assert "vserve:num_requests_running" in r.text
