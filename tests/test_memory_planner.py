"""The memory planner: parameter and byte counts of published shapes, the seeds' 7B figures, the KV/TP rules,
the GPU budget arithmetic and verdicts, and the CPU path that the engine's allocated block count equals."""

import pytest

from vserve.core.memory import (
    TIGHT_CONCURRENCY,
    GiB,
    default_cpu_kv_budget,
    dequant_buffer_bytes,
    kv_bytes_per_token,
    num_params,
    plan_memory,
    weights_bytes,
)
from vserve.core.model_config import ModelConfig
from vserve.ops.model_shapes import KNOWN_SHAPES, known_shape, planning_config, read_model_config

GB = 10**9


@pytest.mark.parametrize(("shape", "billions"), [
    ("llama-2-7b", 6.74), ("llama-2-13b", 13.02), ("llama-2-70b", 68.98), ("llama-3.1-8b", 8.03),
    ("llama-3.1-70b", 70.55), ("mistral-7b", 7.25), ("qwen2.5-7b", 7.62), ("qwen2.5-72b", 72.71),
    ("yi-34b", 34.39), ("mixtral-8x7b", 46.70), ("smollm2-135m", 0.135),
])
def test_parameter_counts_match_the_published_models(shape, billions):
    assert num_params(known_shape(shape)) / 1e9 == pytest.approx(billions, rel=0.005)


def _non_kv(quantization):
    return plan_memory(known_shape("llama-2-7b"), gpu_memory_bytes=80 * GiB, quantization=quantization).non_kv_bytes


def test_7b_needs_about_14_gb_in_fp16_10_in_8_bit_6_in_4_bit():
    """The seeds' figures, within 15%: weights plus runtime (activations, CUDA graphs, context)."""
    m = known_shape("llama-2-7b")
    assert weights_bytes(m, 2) == pytest.approx(14 * GB, rel=0.15)
    assert _non_kv(None) == pytest.approx(14 * GB, rel=0.15)
    assert _non_kv("int8") == pytest.approx(10 * GB, rel=0.15)
    assert _non_kv("awq") == pytest.approx(6 * GB, rel=0.15)


def test_weight_only_layers_reserve_the_dequantize_buffer_when_estimated():
    """Batches of W4A16 / W8A16 rows dequantize each weight into one model-dtype buffer (kernels/triton_w4a16.py
    dequant_buffer): an estimated plan reserves the largest linear weight of a rank (Llama-3-8B: gate_up, 28672 x
    4096 in bf16; TP=2: half of it); W8A8 does not use it, and a measured peak (the profile pass made it) is taken
    as is."""
    m = known_shape("llama-3.1-8b")

    def acts(q, tp=1, **kw):
        return plan_memory(m, gpu_memory_bytes=80 * GiB, quantization=q, tensor_parallel_size=tp, **kw).activation_bytes

    assert dequant_buffer_bytes(m, 2) == 28672 * 4096 * 2
    assert acts("awq") - acts(None) == acts("gptq") - acts(None) == 28672 * 4096 * 2
    assert acts("awq", tp=2) - acts(None, tp=2) == 14336 * 4096 * 2
    assert acts("fp8") == acts("int8") == acts(None)
    assert acts("awq", peak_activation_bytes=123) == 123


def test_group_quantization_counts_bits_scales_and_zeros():
    m = known_shape("llama-2-7b")
    H, I, L, V = 4096, 11008, 32, 32000
    linear = [(H, 3 * H), (H, H), (H, 2 * I), (I, H)]  # (in, out) of qkv, o, gate_up, down
    other = (2 * V * H + (2 * L + 1) * H) * 2  # embeddings, lm_head, norms in fp16
    awq = other + L * sum(i * o // 2 + o * (i // 128) * 2 + o * (i // 128) // 2 for i, o in linear)
    assert weights_bytes(m, 2, "awq") == awq
    int8 = other + L * sum(i * o + o * 4 for i, o in linear)  # one float32 scale per output channel
    assert weights_bytes(m, 2, "int8") == int8


def test_kv_bytes_per_token_split_over_ranks_and_replicated_below_one_head():
    m = known_shape("llama-3.1-8b")  # 32 layers, 8 KV heads of 128
    assert kv_bytes_per_token(m, 2) == 2 * 32 * 8 * 128 * 2 == 128 * 1024 == m.kv_bytes_per_token(2)
    assert kv_bytes_per_token(m, 2, 2) == 64 * 1024
    assert kv_bytes_per_token(m, 2, 8) == 16 * 1024
    assert kv_bytes_per_token(m, 2, 16) == 16 * 1024  # 8 heads over 16 ranks: one replicated head each


def test_tensor_parallel_shards_weights_but_replicates_norms():
    m = known_shape("llama-2-70b")
    one, two = weights_bytes(m, 2), weights_bytes(m, 2, tensor_parallel_size=2)
    assert one / 2 < two < one / 2 + 2 * (2 * 80 + 1) * 8192


def test_tensor_parallel_size_must_fit_the_heads():
    with pytest.raises(ValueError, match="--tensor-parallel-size must divide the model's 32 attention heads, got 3"):
        plan_memory(known_shape("llama-3.1-8b"), gpu_memory_bytes=80 * GiB, tensor_parallel_size=3)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="--quantization must be one of awq, gptq, fp8, int8, got 'nf4'"):
        plan_memory(known_shape("llama-3.1-8b"), gpu_memory_bytes=80 * GiB, quantization="nf4")


def test_gpu_plan_gives_the_kv_cache_everything_the_utilization_leaves():
    p = plan_memory(known_shape("llama-3.1-8b"), gpu_memory_bytes=80 * GiB, gpu_memory_utilization=0.9,
                    max_model_len=8192)
    assert p.budget_bytes == int(0.9 * 80 * GiB)
    reserved = p.weights_bytes + p.activation_bytes + p.cuda_graph_bytes + p.runtime_bytes
    assert 0 <= p.budget_bytes - reserved - p.kv_cache_bytes < p.kv_bytes_per_block
    assert p.kv_cache_bytes == p.num_blocks * 16 * 128 * 1024
    assert p.max_concurrency == p.num_blocks * 16 / 8192
    assert p.max_model_len_fit == 131072  # the cache holds more than the model's context
    assert p.torch_peak_bytes == p.total_bytes - p.runtime_bytes
    assert p.verdict == "fits"


def test_other_processes_and_measured_memory_shrink_the_cache():
    m = known_shape("llama-3.1-8b")
    base = plan_memory(m, gpu_memory_bytes=80 * GiB)
    crowded = plan_memory(m, gpu_memory_bytes=80 * GiB, other_processes_bytes=10 * GiB)
    assert base.kv_cache_bytes - crowded.kv_cache_bytes == pytest.approx(10 * GiB, abs=base.kv_bytes_per_block)
    measured = plan_memory(m, gpu_memory_bytes=80 * GiB, in_use_bytes=20 * GiB, peak_activation_bytes=GiB)
    assert measured.kv_cache_bytes // measured.kv_bytes_per_block == measured.num_blocks
    assert measured.num_blocks == (int(0.9 * 80 * GiB) - 20 * GiB - GiB - measured.cuda_graph_bytes) // (16 * 131072)


def test_70b_fp16_on_one_a10g_is_oom_with_a_reason():
    p = plan_memory(known_shape("llama-2-70b"), gpu_memory_bytes=24 * GiB * 15 // 16)
    assert (p.verdict, p.num_blocks) == ("oom", 0)
    assert p.weights_bytes / GiB == pytest.approx(128.5, abs=0.1)
    assert p.reason.startswith("the model needs 131.46 GiB per GPU (weights 128.48 GiB")
    assert p.reason.endswith("but 20.25 GiB is available (0.9 x 22.50 GiB)")
    with pytest.raises(ValueError, match="the model needs 131.46 GiB per GPU"):
        p.check()


def test_7b_fp16_on_a_4090_is_tight_and_8_bit_fits():
    m = known_shape("llama-2-7b")
    fp16 = plan_memory(m, gpu_memory_bytes=24 * GiB, max_model_len=4096)
    assert fp16.verdict == "tight" and 3 < fp16.max_concurrency < TIGHT_CONCURRENCY
    fp8 = plan_memory(m, gpu_memory_bytes=24 * GiB, max_model_len=4096, quantization="fp8")
    assert fp8.verdict == "fits" and fp8.max_concurrency > 6


def test_a_sequence_longer_than_the_cache_is_oom():
    p = plan_memory(known_shape("llama-3.1-8b"), gpu_memory_bytes=24 * GiB)  # 131072-token context
    assert p.verdict == "oom" and p.reason.startswith("the KV cache holds ")
    assert 0 < p.max_model_len_fit < 131072


def test_fixed_kv_budget_is_capped_at_max_num_seqs_full_sequences():
    m = known_shape("smollm2-135m")
    p = plan_memory(m, gpu_memory_bytes=None, dtype_bytes=4, max_model_len=1024, max_num_seqs=2,
                    kv_cache_bytes=GiB)
    assert p.num_blocks == 2 * 1024 // 16
    forced = plan_memory(m, gpu_memory_bytes=None, dtype_bytes=4, max_model_len=1024, num_kv_blocks=7)
    assert (forced.num_blocks, forced.verdict) == (7, "oom")
    with pytest.raises(ValueError, match=r"^the KV cache holds 7 blocks of 16 tokens \(112 tokens"):
        forced.check()


def test_cpu_path_uses_the_default_budget():
    m = known_shape("smollm2-135m")
    p = plan_memory(m, gpu_memory_bytes=None, dtype_bytes=4, max_model_len=1024, max_num_seqs=1_000_000)
    assert p.device == "cpu" and p.runtime_bytes == p.cuda_graph_bytes == 0
    assert p.num_blocks == pytest.approx(default_cpu_kv_budget() // p.kv_bytes_per_block, rel=0.01)


def test_cpu_budget_holds_one_full_sequence_when_free_pages_are_few(monkeypatch):
    """A CI runner half way through the suite had 1.24 GiB free (the rest page cache): a quarter of it held 452
    blocks, short of SmolLM2's 8192-token sequence (512). The budget counts reclaimable memory (MemAvailable)
    and grows to one full sequence where half the available memory holds it; below that the plan says oom."""
    import vserve.core.memory as memory

    m = known_shape("smollm2-135m")
    monkeypatch.setattr(memory, "cpu_available_bytes", lambda: int(1.24 * GiB))
    p = plan_memory(m, gpu_memory_bytes=None, dtype_bytes=4, max_model_len=8192)
    assert p.verdict != "oom" and p.num_blocks == 512 and p.kv_cache_bytes == 512 * p.kv_bytes_per_block
    monkeypatch.setattr(memory, "cpu_available_bytes", lambda: int(0.5 * GiB))
    p = plan_memory(m, gpu_memory_bytes=None, dtype_bytes=4, max_model_len=8192)
    assert p.verdict == "oom" and p.num_blocks < 512
    with pytest.raises(ValueError, match="lower --max-model-len or give the cache more memory"):
        p.check()


def test_cpu_available_bytes_reads_mem_available():
    import vserve.core.memory as memory

    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert memory.cpu_available_bytes() == pytest.approx(kib * 1024, rel=0.2)


def test_moe_weights_count_every_expert_and_activations_only_the_routed_ones():
    m = known_shape("mixtral-8x7b")
    dense = planning_config({**KNOWN_SHAPES["mixtral-8x7b"], "architectures": ["MistralForCausalLM"],
                             "num_local_experts": None})
    assert num_params(m) - num_params(dense) == pytest.approx(7 * 32 * 3 * 4096 * 14336, rel=0.001)
    p = plan_memory(m, gpu_memory_bytes=4 * 80 * GiB)
    assert p.weights_bytes / GiB == pytest.approx(87.0, abs=0.1)


def test_model_config_from_a_config_json_file_or_folder(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(KNOWN_SHAPES["qwen2.5-7b"]))
    for source in (tmp_path, tmp_path / "config.json", "qwen2.5-7b"):
        m = read_model_config(source)
        assert isinstance(m, ModelConfig) and (m.num_key_value_heads, m.attention_bias) == (4, True)
    with pytest.raises(ValueError, match="is not a folder with config.json"):
        read_model_config(tmp_path / "nope")


# ---- the engine's CPU cache equals the planner's -----------------------------------------------------------

@pytest.mark.parametrize("engine_args", [{"kv_cache_memory_gib": 0.01},
                                         {"kv_cache_memory_gib": 0.01, "max_num_seqs": 2}, {"max_num_seqs": 4}])
def test_engine_cpu_block_count_equals_the_plan(tiny_model, engine_args):
    from vserve import LLM

    llm = LLM(model=str(tiny_model("llama")), dtype="float32", device="cpu", **engine_args)
    engine = llm.llm_engine
    c = engine.config
    plan = plan_memory(engine.model_config, gpu_memory_bytes=None, dtype_bytes=4, block_size=c.block_size,
                       max_model_len=engine.max_model_len, max_num_seqs=c.max_num_seqs,
                       max_num_batched_tokens=c.max_num_batched_tokens,
                       kv_cache_bytes=c.kv_cache_memory_gib * GiB if c.kv_cache_memory_gib else None)
    assert engine.core.kv.pool.num_blocks == plan.num_blocks
    assert plan.kv_bytes_per_block == 2 * 2 * 2 * 16 * 4 * 16  # K+V, 2 layers, 2 KV heads of 16, fp32, 16 tokens
    assert plan.kv_cache_bytes <= (c.kv_cache_memory_gib * GiB if c.kv_cache_memory_gib else default_cpu_kv_budget())
