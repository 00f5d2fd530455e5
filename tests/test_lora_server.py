"""`vserve serve --enable-lora --lora-modules a=PATH --lora-modules b=PATH`: adapters listed by /v1/models with the
base model as parent, selected by `model` (the openai SDK's output equals the offline engine's with that adapter);
runtime load/unload only with --enable-lora-runtime-updating (else 404), behind the API key; a bad adapter is a 400
with the reason and nothing loaded; vserve:lora_requests_info names the running adapters."""

import threading

import httpx
import openai
import pytest
from lora_fixtures import ALL, make_adapter

from vserve import LLM, SamplingParams

KEY = "s3cret"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-server")
    return {"a": make_adapter(base, tmp / "a", 8, 16, ["q_proj", "v_proj", "down_proj"], seed=11),
            "b": make_adapter(base, tmp / "b", 16, 16, ALL, seed=12),
            "big": make_adapter(base, tmp / "big", 32, 32, ["q_proj"], seed=13)}


def _args(base, adapters, *extra):
    return [str(base), "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu", "--max-model-len",
            "256", "--enable-lora", "--max-loras", "2", "--lora-modules", f"a={adapters['a']}", "--lora-modules",
            f"b={adapters['b']}", *extra]


@pytest.fixture(scope="module")
def server(server_factory, base, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "lora-server.log"
    return server_factory(_args(base, adapters, "--api-key", KEY, "--enable-lora-runtime-updating"), log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(base, adapters):
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=256, enable_lora=True, max_loras=2)
    for name in ("a", "b"):
        llm.add_lora_adapter(name, str(adapters[name]))
    return llm


def _offline_text(offline, name, max_tokens=16):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    return offline.generate(PROMPT, sp, use_tqdm=False, lora_adapter=name)[0].outputs[0].text


def test_models_lists_adapters_with_the_base_as_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:3] == ["tiny", "a", "b"]
    assert cards["a"].parent == "tiny" and cards["a"].root == str(adapters["a"])
    assert cards["tiny"].parent is None


def test_model_selects_the_adapter_as_offline(client, offline):
    texts = {}
    for model in ("tiny", "a", "b"):
        resp = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=16)
        assert resp.model == model
        texts[model] = resp.choices[0].text
        assert texts[model] == _offline_text(offline, None if model == "tiny" else model), model
    assert len(set(texts.values())) == 3  # each adapter changes the output
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=8)
    assert chat.model == "a"
    with pytest.raises(openai.NotFoundError, match="`a`, `b`"):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=4)


def test_runtime_load_and_unload_behind_the_key(server, client, adapters, offline):
    url = server.url + "/v1/load_lora_adapter"
    body = {"lora_name": "c", "lora_path": str(adapters["a"])}
    assert httpx.post(url, json=body).status_code == 401  # the API key is honoured
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url, json=body, headers=auth)
    assert r.status_code == 200, r.text
    resp = client.completions.create(model="c", prompt=PROMPT, temperature=0, max_tokens=16)
    assert resp.choices[0].text == _offline_text(offline, "a")  # "c" is adapter a's folder under another name

    for bad, reason in [({"lora_name": "d", "lora_path": "/no/such/adapter"}, "is not a folder"),
                        ({"lora_name": "d", "lora_path": str(adapters["big"])}, "rank 32, above --max-lora-rank 16"),
                        ({"lora_name": "a", "lora_path": str(adapters["b"])}, "already loaded")]:
        r = httpx.post(url, json=bad, headers=auth)
        assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b", "c"]  # nothing loaded

    unload = server.url + "/v1/unload_lora_adapter"
    assert httpx.post(unload, json={"lora_name": "c"}).status_code == 401
    assert httpx.post(unload, json={"lora_name": "c"}, headers=auth).status_code == 200
    assert httpx.post(unload, json={"lora_name": "c"}, headers=auth).status_code == 404
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=4)


def test_lora_requests_info_names_the_running_adapter(server, client):
    started = threading.Event()

    def long_request():
        stream = client.completions.create(model="b", prompt=PROMPT, temperature=0, max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        for _ in stream:
            started.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert started.wait(60)
    metrics = httpx.get(server.url + "/metrics").text
    t.join(120)
    line = next(x for x in metrics.splitlines() if x.startswith("vserve:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters="b"' in line and 'waiting_lora_adapters=""' in line


def test_runtime_updating_routes_are_404_without_the_flag(server_factory, base, adapters, tmp_path):
    s = server_factory(_args(base, adapters), tmp_path / "plain.log")
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        r = httpx.post(f"{s.url}/v1/{route}", json={"lora_name": "c", "lora_path": str(adapters["a"])})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    assert c.completions.create(model="a", prompt=PROMPT, temperature=0, max_tokens=4).model == "a"


def test_serve_refuses_bad_lora_modules_in_one_line(base, adapters):
    from typer.testing import CliRunner

    from vserve.cli.main import app

    for args, reason in [(["--lora-modules", f"a={adapters['a']}"], "--lora-modules needs --enable-lora"),
                         (["--enable-lora", "--lora-modules", "a"], "--lora-modules takes name=path, got 'a'")]:
        res = CliRunner().invoke(app, ["serve", str(base), "--device", "cpu", *args])
        assert res.exit_code == 2 and reason in res.output, res.output
