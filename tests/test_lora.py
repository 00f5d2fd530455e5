"""Multi-LoRA serving on CPU (float32): in ONE batch mixing two PEFT adapters and the base model, each prompt's greedy
tokens equal HF's with that adapter merged by peft; through vLLM's lora_request and the seeds' add_lora_adapter;
prefix caching keyed by adapter; one slot for three adapters (requests wait, all finish, same tokens); bad adapters
refused with the reason."""

import json
import random

import pytest
from lora_fixtures import ALL, make_adapter, merged_copy

from vserve import LLM, LoRARequest, SamplingParams

NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _prompts(n=3, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(k)] for k in (7, 19, 40)[:n]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tiny_model, tmp_path_factory, hf_greedy):
    """(base folder, {name: adapter folder}, {name or None: HF reference tokens per prompt})."""
    base = tiny_model(request.param)
    tmp = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {
        "a": make_adapter(base, tmp / "a", 8, 16, ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], seed=1),
        "b": make_adapter(base, tmp / "b", 16, 8, ALL, seed=2, rslora=True),
        "c": make_adapter(base, tmp / "c", 4, 8, ["k_proj", "up_proj"], seed=3),
    }
    prompts = _prompts()
    ref = {None: hf_greedy(base, prompts, NEW)}
    for name, folder in adapters.items():
        ref[name] = hf_greedy(merged_copy(base, folder, tmp / f"merged-{name}"), prompts, NEW)
    for name in adapters:
        assert ref[name] != ref[None], f"adapter {name} must change the tokens, or the test shows nothing"
    return base, adapters, ref


def _llm(base, **kw):
    return LLM(str(base), dtype="float32", device="cpu", skip_tokenizer_init=True, enable_lora=True, **kw)


def _mixed():
    """Every prompt under a, b and no adapter: one batch of 9 requests."""
    prompts = _prompts()
    rows = [(p, i, name) for name in ("a", None, "b") for i, p in enumerate(prompts)]
    return rows


def test_mixed_batch_equals_hf_peft_merged_through_lora_request(setup):
    base, adapters, ref = setup
    llm = _llm(base, max_loras=2)
    rows = _mixed()
    ids = {"a": 1, "b": 2}
    reqs = [None if name is None else LoRARequest(name, ids[name], str(adapters[name])) for _, _, name in rows]
    runner, steps = llm.llm_engine.core.runner, []
    build = runner.build_step

    def spy(sched, block_ids):
        step, sample = build(sched, block_ids)
        steps.append((len(sched.requests), sorted(set(step.lora_slots.tolist()))))
        return step, sample

    runner.build_step = spy
    outs = llm.generate([p for p, _, _ in rows], GREEDY, use_tqdm=False, lora_request=reqs)
    for (_p, i, name), out in zip(rows, outs):
        assert out.outputs[0].token_ids == ref[name][i], f"prompt {i} under adapter {name}"
    assert steps[0] == (9, [-1, 0, 1])  # ONE batch: all nine requests, rows of both adapters and of none
    assert all(s == (9, [-1, 0, 1]) for s in steps)


def test_mixed_batch_through_add_lora_adapter(setup):
    base, adapters, ref = setup
    llm = _llm(base, max_loras=2, max_lora_rank=16)
    llm.add_lora_adapter("a", str(adapters["a"]))
    llm.add_lora_adapter("b", str(adapters["b"]))
    assert llm.list_lora_adapters() == ["a", "b"]
    assert sorted(llm.llm_engine.core.runner.lora.cpu) == [1, 2]  # read at add time, not in a step
    rows = _mixed()
    outs = llm.generate([p for p, _, _ in rows], GREEDY, use_tqdm=False, lora_adapter=[n for _, _, n in rows])
    for (_p, i, name), out in zip(rows, outs):
        assert out.outputs[0].token_ids == ref[name][i], f"prompt {i} under adapter {name}"
    llm.remove_lora_adapter("a")
    assert llm.list_lora_adapters() == ["b"]
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        llm.generate([rows[0][0]], GREEDY, use_tqdm=False, lora_adapter="a")
    llm.add_lora_adapter("a", str(adapters["c"]))  # a name reused for another adapter: its own cache keys
    out = llm.generate(_prompts()[2], GREEDY, use_tqdm=False, lora_adapter="a")
    assert out[0].outputs[0].token_ids == ref["c"][2]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_slot_three_adapters_all_finish_with_the_same_tokens(setup, async_scheduling):
    """With async scheduling too: step N+1 is scheduled (and a freed slot reloaded) while step N is in flight."""
    base, adapters, ref = setup
    llm = _llm(base, max_loras=1, max_cpu_loras=2, async_scheduling=async_scheduling)
    for name in "abc":
        llm.add_lora_adapter(name, str(adapters[name]))
    prompts = _prompts()
    rows = [(p, i, name) for i, p in enumerate(prompts) for name in ("a", "b", None, "c")]
    outs = llm.generate([p for p, _, _ in rows], GREEDY, use_tqdm=False, lora_adapter=[n for _, _, n in rows])
    for (_p, i, name), out in zip(rows, outs):
        assert out.outputs[0].token_ids == ref[name][i], f"prompt {i} under adapter {name}"
    slots = llm.llm_engine.core.scheduler.lora
    assert not slots.holders and not slots.users  # every slot released
    # first come, first served: a request whose adapter finds the slot busy waits, and so do those behind it, so
    # the slot swaps a -> b -> c for each prompt's group
    assert slots.num_loads == 9


def test_prefix_cache_is_keyed_by_adapter(setup):
    base, adapters, ref = setup
    llm = _llm(base, max_loras=2, block_size=16)
    llm.add_lora_adapter("a", str(adapters["a"]))
    llm.add_lora_adapter("b", str(adapters["b"]))
    prompt = _prompts()[2]  # 40 tokens: two full blocks to reuse
    engine = llm.llm_engine

    def run(name):
        hits = engine.stats().prefix_cache_hits
        out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_adapter=name)[0]
        assert out.outputs[0].token_ids == ref[name][2]
        return engine.stats().prefix_cache_hits - hits, out.num_cached_tokens

    assert run("a") == (0, 0)
    assert run("b") == (0, 0)  # the same prompt under another adapter computes again
    assert run(None) == (0, 0)  # and under the base model
    assert run("a") == (32, 32)  # under the same adapter it hits
    assert run("b") == (32, 32)


def test_bad_adapters_are_refused_with_the_reason(setup, tmp_path):
    base, adapters, _ = setup
    llm = _llm(base, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16, above --max-lora-rank 8"):
        llm.add_lora_adapter("b", str(adapters["b"]))
    with pytest.raises(ValueError, match="is not a folder"):
        llm.add_lora_adapter("x", str(tmp_path / "missing"))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (pickled / "adapter_model.bin").write_bytes(b"\x80")
    with pytest.raises(ValueError, match="pickled weights"):
        llm.add_lora_adapter("x", str(pickled))
    emb = tmp_path / "emb"
    make_adapter(base, emb, 8, 8, ["q_proj", "embed_tokens"], seed=4)
    with pytest.raises(ValueError, match="embeddings or the LM head"):
        llm.add_lora_adapter("x", str(emb))
    llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=[LoRARequest("a", 1, str(adapters["a"]))])
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a'"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("c", 1, str(adapters["c"])))
    assert llm.list_lora_adapters() == []
    plain = LLM(str(base), dtype="float32", device="cpu", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters["a"])))


def test_engine_process_front_end_serves_adapters(setup):
    """The core in its own process: adapters checked in the front end, loaded in the engine process."""
    base, adapters, ref = setup
    llm = _llm(base, max_loras=2, engine_process=True)
    try:
        llm.add_lora_adapter("a", str(adapters["a"]))
        rows = _mixed()
        reqs = [None if n != "b" else LoRARequest("b", 7, str(adapters["b"])) for _, _, n in rows]
        names = ["a" if n == "a" else None for _, _, n in rows]
        # per prompt either a LoRARequest or a name: two calls, both through the engine process
        outs = llm.generate([p for p, _, _ in rows], GREEDY, use_tqdm=False, lora_request=reqs)
        outs_a = llm.generate([p for p, _, _ in rows], GREEDY, use_tqdm=False, lora_adapter=names)
        for (_p, i, name), out, out_a in zip(rows, outs, outs_a):
            assert out.outputs[0].token_ids == ref[None if name == "a" else name][i]
            assert out_a.outputs[0].token_ids == ref[None if name == "b" else name][i]
        llm.remove_lora_adapter("a")
        assert llm.generate(_prompts()[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref[None][0]
    finally:
        llm.llm_engine.shutdown()


def test_tp2_on_gloo_equals_tp1(setup):
    """A and B shard as their base layers (column-parallel: B's rows; row-parallel: A's input columns, the rank-R
    partial products all-reduced): the mixed batch under TP=2 gives TP=1's tokens (= HF's)."""
    import torch.distributed as dist

    base, adapters, ref = setup
    llm = _llm(base, max_loras=2, tensor_parallel_size=2, max_num_batched_tokens=32)  # chunked prefill too
    try:
        llm.add_lora_adapter("a", str(adapters["a"]))
        llm.add_lora_adapter("b", str(adapters["b"]))
        rows = _mixed()
        outs = llm.generate([p for p, _, _ in rows], GREEDY, use_tqdm=False, lora_adapter=[n for _, _, n in rows])
        for (_p, i, name), out in zip(rows, outs):
            assert out.outputs[0].token_ids == ref[name][i], f"prompt {i} under adapter {name}"
    finally:
        llm.llm_engine.shutdown()
    assert not dist.is_initialized()


def test_memory_plan_counts_the_adapter_slots_the_engine_holds(setup):
    base, _, _ = setup
    llm = _llm(base, max_loras=3, max_lora_rank=32)
    plan = llm.llm_engine.info.memory_plan
    assert plan["lora_bytes"] == llm.llm_engine.core.runner.lora.nbytes() > 0
    assert plan["non_kv_bytes"] - plan["lora_bytes"] == LLM(
        str(base), dtype="float32", device="cpu", skip_tokenizer_init=True).llm_engine.info.memory_plan["non_kv_bytes"]


def test_planner_and_doctor_count_lora_slots_for_an_8b_model():
    from vserve.core.memory import GiB, plan_memory
    from vserve.ops.model_shapes import known_shape

    m = known_shape("llama-3.1-8b")
    base = plan_memory(m, gpu_memory_bytes=80 * GiB, max_model_len=8192)
    five = plan_memory(m, gpu_memory_bytes=80 * GiB, max_model_len=8192, max_loras=5, max_lora_rank=16)
    # per layer and slot, rank 16: A 16 x (3 x 4096 + 4096 + 2 x 4096 + 14336), B (6144 + 4096 + 28672 + 4096) x 16
    per_slot_layer = 16 * (3 * 4096 + 4096 + 2 * 4096 + 14336) + (6144 + 4096 + 2 * 14336 + 4096) * 16
    assert five.lora_bytes == 5 * 32 * per_slot_layer * 2  # bf16: 5 adapters are ~0.4% of the 16 GB of weights
    assert five.kv_cache_bytes < base.kv_cache_bytes
    assert base.kv_cache_bytes - five.kv_cache_bytes < five.lora_bytes + five.kv_bytes_per_block
    assert five.non_kv_bytes == base.non_kv_bytes + five.lora_bytes


def test_doctor_plans_the_lora_slots(monkeypatch):
    from typer.testing import CliRunner

    from vserve.cli.main import app
    from vserve.ops import probe
    from vserve.ops.doctor import Environment

    monkeypatch.setattr(probe, "probe_environment", lambda: Environment(gpus=[]))
    args = ["doctor", "llama-3.1-8b", "--profile", "h200", "--max-model-len", "8192", "--json"]
    plain = json.loads(CliRunner().invoke(app, args).stdout)["plan"]
    lora = json.loads(CliRunner().invoke(app, [*args, "--max-loras", "5"]).stdout)["plan"]
    assert plain["lora_bytes"] == 0 and lora["lora_bytes"] > 0
    assert lora["kv_cache_bytes"] < plain["kv_cache_bytes"]
    bad = CliRunner().invoke(app, [*args, "--max-lora-rank", "12"])
    assert bad.exit_code == 2 and "--max-lora-rank must be one of" in bad.output


def test_lora_flags_validate_and_show_their_source():
    from vserve.core.config import EngineConfig

    cfg = EngineConfig.resolve({"enable_lora": True, "max_loras": 4, "max_lora_rank": None})
    rows = {flag: (value, source) for flag, value, source in cfg.describe()}
    assert rows["--enable-lora"] == (True, "flag") and rows["--max-loras"] == (4, "flag")
    assert rows["--max-lora-rank"] == (16, "default") and rows["--max-cpu-loras"] == (None, "default")
    for flags, message in [({"max_loras": 0}, "--max-loras must be >= 1, got 0"),
                           ({"max_loras": 4, "max_cpu_loras": 2}, "--max-cpu-loras must be >= --max-loras"),
                           ({"max_lora_rank": 24}, "--max-lora-rank must be one of 8, 16, 32"),
                           ({"enable_lora": True, "pipeline_parallel_size": 2}, "with --enable-lora")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.resolve(flags)


def test_bench_throughput_spreads_random_adapters_over_the_requests(tiny_model, monkeypatch):
    """`vserve bench throughput --num-loras 3 --lora-rank 8` on CPU: three random adapters (all seven projections)
    round-robin over the requests, every token generated; the report says so."""
    from typer.testing import CliRunner

    import vserve.cli.bench as bench
    from vserve.cli.main import app

    seen = []
    real_generate = LLM.generate

    def generate(self, prompts, params=None, use_tqdm=True, lora_request=None, **kw):
        if isinstance(params, list) and len(prompts) == 7:  # the timed run
            seen.append([(lr.lora_name, lr.lora_int_id) for lr in lora_request])
            seen.append(sorted(self.llm_engine.core.runner.lora.cpu))  # warmed up: every adapter read
        return real_generate(self, prompts, params, use_tqdm, lora_request=lora_request, **kw)

    monkeypatch.setattr(LLM, "generate", generate)
    args = ["bench", "throughput", "--model", str(tiny_model("llama")), "--device", "cpu", "--dtype", "float32",
            "--num-prompts", "7", "--input-len", "8", "--output-len", "3", "--num-loras", "3", "--lora-rank", "8",
            "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["output_tokens"] == 21 and out["lora"] == {"num_loras": 3, "rank": 8, "max_loras": 3}
    # three rank-8 slots on the seven projections as allocated (the plan's figure holds rank 16: its minimum)
    mem = out["memory"]
    assert 0 < mem["lora_slot_bytes"] <= mem["lora_bytes"] and mem["weights_bytes"] > 0
    names = [f"lora-{i % 3}" for i in range(7)]
    assert seen == [[(n, int(n[-1]) + 1) for n in names], [1, 2, 3]]
    bad = CliRunner().invoke(app, [*args[:-1], "--backend", "hf"])
    assert bad.exit_code == 2 and "--num-loras runs vserve only" in bad.output
    assert bench.lora_engine_args({"max_loras": None, "max_lora_rank": None}, 4, 20) == {
        "enable_lora": True, "max_loras": 4, "max_lora_rank": 32}


def test_adapter_by_hub_id_fetches_only_its_two_files(setup, monkeypatch, tmp_path):
    """An adapter named by hub id (tests/hub_server.py stands in for the hub): only adapter_config.json and
    adapter_model.safetensors are fetched, the engine gets the cached folder, the tokens are the local adapter's;
    a pickle-only adapter repo is refused before any download."""
    from hub_server import HubServer, folder_files

    base, adapters, ref = setup
    with HubServer() as hub:
        hub.use(monkeypatch)
        hub.add("org/adapter-a", {**folder_files(adapters["a"]), "README.md": b"# a\n",
                                  "adapter_model.bin": b"\x80\x02pickle"})
        hub.add("org/pickled", {"adapter_config.json": (adapters["a"] / "adapter_config.json").read_bytes(),
                                "adapter_model.bin": b"\x80\x02pickle"})
        llm = _llm(base, download_dir=str(tmp_path / "cache"))
        llm.add_lora_adapter("h", "org/adapter-a")
        assert sorted(hub.fetched()) == ["adapter_config.json", "adapter_model.safetensors"]
        out = llm.generate(_prompts()[1], GREEDY, use_tqdm=False, lora_adapter="h")
        assert out[0].outputs[0].token_ids == ref["a"][1]
        assert llm.llm_engine.loras.by_name["h"].lora_path.startswith(str(tmp_path / "cache"))
        hub.clear()
        with pytest.raises(ValueError, match="holds no adapter_model.safetensors"):
            llm.add_lora_adapter("p", "org/pickled")
        assert hub.fetched() == []


def test_chat_takes_the_adapter_as_generate_does(setup):
    base, adapters, _ = setup
    llm = LLM(str(base), dtype="float32", device="cpu", enable_lora=True)
    llm.add_lora_adapter("a", str(adapters["a"]))
    conv = [{"role": "user", "content": "Say something."}]
    ids = llm.apply_chat_template(conv)
    chat = llm.chat(conv, GREEDY, use_tqdm=False, lora_adapter="a")[0].outputs[0].token_ids
    assert chat == llm.generate(ids, GREEDY, use_tqdm=False, lora_adapter="a")[0].outputs[0].token_ids
    assert chat != llm.chat(conv, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
