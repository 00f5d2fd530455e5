"""W8A8 inputs quantized per token by the kernel that produces them (RMSNorm, fused add + RMSNorm, SiLU-and-mul;
Triton under its interpreter on CPU): the same codes and scales, bit for bit, as producing the activation and then
quantizing it, so a W8A8 model's logits do not change with the fusion; other models never take it."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import json  # noqa: E402
import shutil  # noqa: E402
from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vserve import kernels  # noqa: E402
from vserve.core import distributed  # noqa: E402
from vserve.core.layers import linear, vocab_parallel_embedding  # noqa: E402
from vserve.core.layers.attention import AttentionMetadata  # noqa: E402
from vserve.core.layers.linear import Linear  # noqa: E402
from vserve.core.loader import build_model  # noqa: E402
from vserve.core.model_config import ModelConfig  # noqa: E402
from vserve.core.model_runner import ModelRunner  # noqa: E402
from vserve.kernels import ops_ref, triton_ops  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # interpreter

FP8, INT8 = torch.float8_e4m3fn, torch.int8
# bf16 only against the unfused kernels: the interpreter's float -> bf16 conversion is not torch's, in both alike
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MIN_SCALE = torch.tensor(ops_ref.MIN_SCALE, dtype=torch.float32)  # an all-zero row's scale
FUSED = ("rms_norm_quant", "fused_add_rms_norm_quant", "silu_and_mul_quant", "fp8_mm", "int8_mm")


def _codes(q: torch.Tensor) -> torch.Tensor:
    """Codes as integers: fp8 by its bit pattern (neighbouring values of one sign differ by 1)."""
    return (q.view(torch.uint8) if q.dtype == FP8 else q).to(torch.int16)


def _assert_same(got: tuple, expected: tuple, seed: int) -> None:
    (q, s), (rq, rs) = got, expected
    assert q.dtype == rq.dtype and s.dtype == torch.float32 and s.shape == rs.shape, (q.dtype, s.shape, seed)
    assert torch.equal(s, rs) and torch.equal(_codes(q), _codes(rq)), f"torch.manual_seed({seed})"


def _assert_near_reference(got: tuple, expected: tuple, dtype: torch.dtype, seed: int) -> None:
    """The Triton norm and SiLU round a value to the other side of a tie now and then (fp32 sums in another order,
    another exp): a scale within the dtype's rounding, codes at most one step apart."""
    if dtype == torch.bfloat16:
        return
    (q, s), (rq, rs) = got, expected
    rtol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(s, rs, rtol=rtol, atol=0, msg=lambda m: f"{m}\n(torch.manual_seed({seed}))")
    assert int((_codes(q) - _codes(rq)).abs().max()) <= 1, f"torch.manual_seed({seed})"


def _rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows of width n, one of them all zeros (the scale's floor) and one with a large outlier."""
    x = torch.randn(7, n) * torch.rand(7, 1) * 4
    x[2] = 0.0
    x[4, n // 3] = 300.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", [FP8, INT8])
def test_rms_norm_quant_gives_the_unfused_kernels_codes_and_scales(seed, dtype, qdtype):
    n = 300  # not a power of two: a masked tail
    x, w = _rows(n, dtype), (1 + 0.1 * torch.randn(n)).to(dtype)
    got = triton_ops.rms_norm_quant(x, w, 1e-6, qdtype)
    _assert_same(got, triton_ops.per_token_quant(triton_ops.rms_norm(x, w, 1e-6), qdtype), seed)
    _assert_near_reference(got, ops_ref.rms_norm_quant_ref(x, w, 1e-6, qdtype), dtype, seed)
    assert int(_codes(got[0])[2].abs().max()) == 0 and got[1][2] == MIN_SCALE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", [FP8, INT8])
def test_fused_add_rms_norm_quant_gives_the_unfused_kernels_codes_scales_and_residual(seed, dtype, qdtype):
    n = 300
    x, w = _rows(n, dtype), (1 + 0.1 * torch.randn(n)).to(dtype)
    res = torch.randn(7, n).to(dtype)
    res[2] = 0.0
    got, new_res = triton_ops.fused_add_rms_norm_quant(x, res, w, 1e-5, qdtype)
    normed, expected_res = triton_ops.fused_add_rms_norm(x, res, w, 1e-5)
    _assert_same(got, triton_ops.per_token_quant(normed, qdtype), seed)
    assert torch.equal(new_res, expected_res), seed
    ref, ref_res = ops_ref.fused_add_rms_norm_quant_ref(x, res, w, 1e-5, qdtype)
    _assert_near_reference(got, ref, dtype, seed)
    if dtype != torch.bfloat16:
        assert torch.equal(new_res, ref_res), seed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qdtype", [FP8, INT8])
@pytest.mark.parametrize("block", [16384, 128])  # the row computed once, and twice in three chunks (max, codes)
def test_silu_and_mul_quant_gives_the_unfused_kernels_codes_and_scales(seed, dtype, qdtype, block):
    x = torch.cat([_rows(300, dtype), _rows(300, dtype).flip(-1)], -1)  # [gate | up], outliers apart (fp16's range)
    got = triton_ops.silu_and_mul_quant(x, qdtype, block=block)
    assert got[0].shape == (7, 300) and got[1].shape == (7, 1)
    _assert_same(got, triton_ops.per_token_quant(triton_ops.silu_and_mul(x), qdtype), seed)
    _assert_near_reference(got, ops_ref.silu_and_mul_quant_ref(x, qdtype), dtype, seed)
    assert int(_codes(got[0])[2].abs().max()) == 0 and got[1][2] == MIN_SCALE


@pytest.mark.parametrize("qdtype", [FP8, INT8])
def test_fused_references_are_the_unfused_references(seed, qdtype):
    x, res, w = torch.randn(4, 96, dtype=torch.bfloat16), torch.randn(4, 96, dtype=torch.bfloat16), torch.rand(96)
    w = w.to(torch.bfloat16)
    _assert_same(ops_ref.rms_norm_quant_ref(x, w, 1e-6, qdtype),
                 ops_ref.per_token_quant_ref(ops_ref.rms_norm_ref(x, w, 1e-6), qdtype), seed)
    got, h = ops_ref.fused_add_rms_norm_quant_ref(x, res, w, 1e-6, qdtype)
    normed, h_ref = ops_ref.fused_add_rms_norm_ref(x, res, w, 1e-6)
    _assert_same(got, ops_ref.per_token_quant_ref(normed, qdtype), seed)
    assert torch.equal(h, h_ref)
    g = torch.randn(4, 192, dtype=torch.bfloat16)
    _assert_same(ops_ref.silu_and_mul_quant_ref(g, qdtype),
                 ops_ref.per_token_quant_ref(ops_ref.silu_and_mul_ref(g), qdtype), seed)


# ---- the model: fused and unfused give the same logits ---------------------------------------------------------


def _prefill(model, cfg: ModelConfig) -> torch.Tensor:
    """The last hidden states of two prompts prefilled together into fresh KV cache blocks."""
    ModelRunner(model, cfg, 16, 2, next(model.parameters()).dtype, torch.device("cpu"))  # binds the KV cache
    lens = [5, 11]
    ids = torch.randint(3, cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])
    md = AttentionMetadata(torch.cat([torch.arange(n) + 16 * i for i, n in enumerate(lens)]), torch.tensor([[0], [1]]),
                           torch.tensor(lens), 0, torch.tensor([0, lens[0], sum(lens)]))
    with torch.inference_mode():
        return model(ids, pos, md)


def _count_fused_calls(monkeypatch) -> Counter:
    """Count the CPU path's calls of the fused kernels and the W8A8 GEMMs taking their output."""
    calls, ops = Counter(), kernels._reference()
    for name in FUSED:
        fn = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _fn=fn, _name=name, **k: calls.update([_name]) or _fn(*a, **k))
    return calls


@pytest.mark.parametrize("flag", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2])
def test_w8a8_model_gives_the_same_logits_with_the_quantization_fused(tiny_model, monkeypatch, flag, dtype, tp):
    """A 2-layer Llama with dummy W8A8 weights. tp=2: rank 0's shards in this process, its all-reduces skipped
    (its partial sums compared): the row-parallel down_proj gets its own slice of the input, quantized per token
    over that slice as before."""
    if tp > 1:
        monkeypatch.setattr(distributed, "_STATE", distributed.ParallelState(rank=0, world_size=tp, tp_size=tp))
        for module in (linear, vocab_parallel_embedding):
            monkeypatch.setattr(module, "all_reduce", lambda x: x)
    folder = tiny_model("llama")
    cfg = ModelConfig.from_pretrained(folder)
    model = build_model(cfg, folder, "dummy", dtype, torch.device("cpu"), quantization=flag)
    calls = _count_fused_calls(monkeypatch)
    fused = _prefill(model, cfg)
    layers = cfg.num_hidden_layers
    assert calls == {"rms_norm_quant": 1, "fused_add_rms_norm_quant": 2 * layers - 1, "silu_and_mul_quant": layers,
                     f"{flag}_mm": 3 * layers}  # qkv, gate_up and down; o_proj quantizes its input itself
    monkeypatch.setattr(Linear, "input_quant_dtype", property(lambda self: None))  # the unfused path
    calls.clear()
    unfused = _prefill(model, cfg)
    assert not calls
    assert torch.equal(fused, unfused)
    if tp == 1:
        assert torch.equal(model.compute_logits(fused), model.compute_logits(unfused))


W8A16 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}


@pytest.mark.parametrize("quant", [None, "awq", "w8a16"])
def test_models_without_w8a8_linears_never_quantize_activations(tiny_model, tmp_path, monkeypatch, quant):
    folder = tiny_model("llama", hidden_size=128, intermediate_size=256)  # AWQ's group 128 divides every input
    if quant == "w8a16":  # a quantization_config for the dummy weights
        folder = shutil.copytree(folder, tmp_path / "w8a16")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": W8A16}))
    cfg = ModelConfig.from_pretrained(folder)
    model = build_model(cfg, folder, "dummy", torch.float32, torch.device("cpu"),
                        quantization=None if quant == "w8a16" else quant)
    assert all(m.input_quant_dtype is None for m in model.modules() if isinstance(m, Linear))
    calls = _count_fused_calls(monkeypatch)
    _prefill(model, cfg)
    assert not calls
