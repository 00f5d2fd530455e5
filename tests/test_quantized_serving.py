"""Quantized checkpoints on CPU: a tiny Llama quantized here into each layout vserve reads (AutoAWQ GEMM, GPTQ
with act-order, compressed-tensors float/int/pack-quantized, vLLM's fp8) generates the greedy tokens of the same
model with the dequantized weights in float32 (for W8A8: with its activations fake-quantized per token as well);
--quantization is checked against the checkpoint; dummy weights build for each flag; TP=2 splits packed int32
along the right axes; the memory planner counts exactly the bytes the loaded layers hold."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vserve import LLM, SamplingParams
from vserve.core import distributed
from vserve.core.loader import build_model
from vserve.core.memory import weights_bytes
from vserve.core.model_config import ModelConfig
from vserve.quantize.formats import dequantize_awq, dequantize_gptq, pack_awq, pack_gptq, pack_int32
from vserve.quantize.rtn import quantize_rtn

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 16
GROUP = 32  # divides every input size of the tiny model per TP rank (64 / 2 and 128 / 2)
FP8_MAX = 448.0


def _ct_args(bits: int, kind: str, strategy: str, dynamic: bool, group: int | None = None) -> dict:
    return {"num_bits": bits, "type": kind, "symmetric": True, "group_size": group, "strategy": strategy,
            "dynamic": dynamic, "actorder": None}


def _ct_config(fmt: str, weights: dict, acts: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "quantization_status": "compressed"}


def _symmetric(w: torch.Tensor, qmax: float, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(w / scale, scale float32 [out, groups]) with scale = max |w| / qmax per output channel (or group)."""
    g = w.shape[1] if group is None else group
    scale = (w.reshape(w.shape[0], -1, g).abs().amax(-1) / qmax).clamp(min=1e-12)
    return w / scale.repeat_interleave(g, 1), scale


def quantize_linear(w: torch.Tensor, layout: str, perm: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One nn.Linear weight [out, in] in a checkpoint layout -> (its tensors by suffix, the dequantized weight).
    perm: GPTQ's act-order of the input channels (shared by the layers reading one input, as GPTQ's Hessian is)."""
    if layout == "awq":
        qweight, qzeros, scales = pack_awq(*quantize_rtn(w, 4, GROUP))
        return dict(qweight=qweight, qzeros=qzeros, scales=scales), dequantize_awq(qweight, qzeros, scales, GROUP)
    if layout.startswith("gptq"):  # act-order: groups follow a random permutation of the input channels
        bits = int(layout[4:])
        q, zeros, scales = quantize_rtn(w[:, perm], bits, GROUP)
        g_idx = torch.empty(w.shape[1], dtype=torch.int32)
        g_idx[perm] = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
        tensors = pack_gptq(q[:, perm.argsort()], zeros, scales, g_idx, bits)
        return dict(zip(("qweight", "qzeros", "scales", "g_idx"), tensors)), dequantize_gptq(*tensors, bits)
    if layout.startswith("pack"):  # compressed-tensors pack-quantized: symmetric, codes + 2^(bits - 1)
        bits = int(layout[4:])
        v, scale = _symmetric(w, 2 ** (bits - 1) - 1, GROUP if bits == 4 else None)
        q = v.round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        g = w.shape[1] // scale.shape[1]
        deq = q * scale.repeat_interleave(g, 1)
        packed = pack_int32(q.to(torch.int64) + 2 ** (bits - 1), bits)
        return dict(weight_packed=packed, weight_scale=scale, weight_shape=torch.tensor(list(w.shape))), deq
    if layout in ("fp8", "fp8_tensor"):
        v, scale = _symmetric(w, FP8_MAX)
        if layout == "fp8_tensor":  # vLLM's fp8: one scale per tensor
            scale = w.abs().max().reshape(()) / FP8_MAX
            v = w / scale
        q = v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return dict(weight=q, weight_scale=scale), q.float() * scale.reshape(-1, 1)
    assert layout == "int8", layout
    v, scale = _symmetric(w, 127.0)
    q = v.round().clamp(-128, 127).to(torch.int8)
    return dict(weight=q, weight_scale=scale.to(torch.bfloat16)), q.float() * scale.to(torch.bfloat16).float()


LAYOUTS = {  # name -> (tensor layout, quantization_config, activations fake-quantized to (None: weight-only))
    "awq": ("awq", {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
                    "modules_to_not_convert": None}, None),
    "gptq4-act-order": ("gptq4", {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
                                  "sym": False, "checkpoint_format": "gptq"}, None),
    "gptq8": ("gptq8", {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": True, "sym": False},
              None),
    "ct-w4a16-pack": ("pack4", _ct_config("pack-quantized", _ct_args(4, "int", "group", False, GROUP), None), None),
    "ct-w8a16-pack": ("pack8", _ct_config("pack-quantized", _ct_args(8, "int", "channel", False), None), None),
    "ct-fp8-w8a8": ("fp8", _ct_config("float-quantized", _ct_args(8, "float", "channel", False),
                                      _ct_args(8, "float", "token", True)), "fp8"),
    "ct-fp8-w8a16": ("fp8", _ct_config("float-quantized", _ct_args(8, "float", "channel", False), None), None),
    "ct-int8-w8a8": ("int8", _ct_config("int-quantized", _ct_args(8, "int", "channel", False),
                                        _ct_args(8, "int", "token", True)), "int8"),
    "vllm-fp8": ("fp8_tensor", {"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Matrices this small run many times faster on one thread than on several contending ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    """make(name) -> (quantized folder, dequantized float32 folder) of the tiny Llama, written once per layout."""
    src = tiny_model("llama")
    made: dict[str, tuple[Path, Path]] = {}

    def make(name: str) -> tuple[Path, Path]:
        if name in made:
            return made[name]
        layout, qcfg, _ = LAYOUTS[name]
        torch.manual_seed(7)
        tensors, deq = load_file(str(src / "model.safetensors")), {}
        quant, perms = {}, {}
        for key, w in sorted(tensors.items()):
            if key.endswith(".weight") and key.split(".")[-2] in LINEARS:
                reader = key.rsplit(".", 2)[0] + key.split(".")[-2].replace("k_", "q_").replace("v_", "q_").replace(
                    "up_", "gate_")  # one permutation per input: q/k/v share one, gate/up another
                perm = perms.setdefault(reader, torch.randperm(w.shape[1]))
                parts, deq[key] = quantize_linear(w, layout, perm)
                prefix = key.removesuffix(".weight")
                quant.update({f"{prefix}.{suffix}": t.contiguous() for suffix, t in parts.items()})
            else:
                quant[key] = deq[key] = w
        folders = []
        for label, weights, config_extra in (("q", quant, {"quantization_config": qcfg}), ("deq", deq, {})):
            out = tmp_path_factory.mktemp(f"{name}-{label}")
            for f in src.iterdir():
                if f.name != "model.safetensors":
                    (out / f.name).write_bytes(f.read_bytes())
            config = json.loads((src / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({**config, **config_extra}))
            save_file(weights, str(out / "model.safetensors"))
            folders.append(out)
        made[name] = tuple(folders)
        return made[name]

    return make


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (7, 30)]


def _greedy(folder: Path, **engine_args) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", device="cpu", skip_tokenizer_init=True, num_kv_blocks=64,
              **engine_args)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def _fake_quant_tokens(x: torch.Tensor, kind: str) -> torch.Tensor:
    """What a W8A8 GEMM sees of its input: each row quantized with scale max|row| / qmax and back."""
    qmax = FP8_MAX if kind == "fp8" else 127.0
    scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp(min=1.0 / (FP8_MAX * 512))
    v = x / scale
    q = v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() if kind == "fp8" else v.round().clamp(-128, 127)
    return q * scale


def _hf_greedy_fake_quant(folder: Path, kind: str) -> list[list[int]]:
    """HF greedy on the dequantized weights, every decoder linear fed per-token fake-quantized activations."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for name, mod in model.named_modules():
        if name.split(".")[-1] in LINEARS:
            mod.register_forward_pre_hook(lambda _m, args: (_fake_quant_tokens(args[0], kind),))
    outs = []
    with torch.inference_mode():
        for p in _prompts():
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_quantized_checkpoint_generates_the_dequantized_models_tokens(checkpoints, name):
    quant, deq = checkpoints(name)
    acts = LAYOUTS[name][2]
    expected = _greedy(deq) if acts is None else _hf_greedy_fake_quant(deq, acts)
    assert _greedy(quant) == expected  # the method is read from config.json


@pytest.mark.parametrize("name", ["awq", "gptq4-act-order", "ct-w4a16-pack"])
def test_the_repacked_tensor_core_layout_generates_the_dequantized_models_tokens(checkpoints, tmp_path, monkeypatch,
                                                                                name):
    """A W4A16 table that repacks every 4-bit weight on this device (kernels/w4a16_configs.json's layout "tc";
    K = 64 and 128 here: padded to a 128-wide tile): every decoder linear is repacked at load, and the model still
    generates the dequantized model's greedy tokens (on CPU the reference computes from the tc layout)."""
    from vserve.kernels import w4a16_dispatch

    table = tmp_path / "w4a16_configs.json"
    table.write_text(json.dumps({"devices": {"cpu": {"default": {"layout": "tc"}}}}))
    monkeypatch.setenv("VSERVE_W4A16_CONFIGS", str(table))
    w4a16_dispatch.reload()
    try:
        quant, deq = checkpoints(name)
        model = build_model(_config(quant), quant, "safetensors", torch.float32, torch.device("cpu"))
        methods = [m.quant_method for m in model.modules() if hasattr(getattr(m, "quant_method", None), "tensors")]
        assert methods and all(m.layout == "tc" for m in methods)
        assert _greedy(quant) == _greedy(deq)
    finally:
        monkeypatch.delenv("VSERVE_W4A16_CONFIGS")
        w4a16_dispatch.reload()


def test_awq_tensor_parallel_2_gives_the_tp1_tokens(checkpoints):
    """Column-parallel q/k/v and gate/up split qweight/qzeros/scales along dim 1 in units of 8 columns;
    row-parallel o/down split them along dim 0 by groups."""
    quant, _ = checkpoints("awq")
    assert _greedy(quant, tensor_parallel_size=2) == _greedy(quant)


# ---- --quantization against the checkpoint ------------------------------------------------------------------


def _config(folder: Path) -> ModelConfig:
    return ModelConfig.from_pretrained(folder)


def test_explicit_flag_that_contradicts_the_checkpoint_is_refused(checkpoints):
    quant, deq = checkpoints("awq")
    with pytest.raises(ValueError, match=r"--quantization gptq contradicts the checkpoint, whose config.json has "
                                         r"quantization_config.quant_method 'awq' \(AWQ 4-bit, group 32\); pass "
                                         r"--quantization awq or leave it out"):
        build_model(_config(quant), quant, "safetensors", torch.float32, torch.device("cpu"), quantization="gptq")
    with pytest.raises(ValueError, match="--quantization awq needs a checkpoint quantized with it, but config.json "
                                         "has no quantization_config"):
        build_model(_config(deq), deq, "safetensors", torch.float32, torch.device("cpu"), quantization="awq")


def test_fp8_and_int8_flags_are_aliases_of_compressed_tensors_checkpoints(checkpoints):
    quant, _ = checkpoints("ct-int8-w8a8")
    for flag in ("int8", "compressed-tensors"):
        model = build_model(_config(quant), quant, "safetensors", torch.float32, torch.device("cpu"),
                            quantization=flag)
        assert model.quant_config.kind == "int8" and model.quant_config.activations == "int8"
    with pytest.raises(ValueError, match="--quantization fp8 contradicts the checkpoint"):
        build_model(_config(quant), quant, "safetensors", torch.float32, torch.device("cpu"), quantization="fp8")


def test_unsupported_quantization_configs_are_named():
    from vserve.core.layers.quantization import QuantConfig

    cases = [({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
             ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv'"),
             ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
             ({"quant_method": "gptq", "bits": 3}, "GPTQ with bits=3"),
             (_ct_config("float-quantized", _ct_args(8, "float", "channel", False),
                         _ct_args(8, "float", "tensor", False)), "static or per-tensor input activation scales")]
    for qcfg, message in cases:
        with pytest.raises(ValueError, match=message):
            QuantConfig.resolve(None, {"quantization_config": qcfg})
    with pytest.raises(ValueError, match="--quantization must be one of awq, gptq, fp8, int8, compressed-tensors"):
        QuantConfig.resolve("nf4", {})


def test_engine_config_accepts_the_five_methods_only():
    from vserve.core.config import EngineConfig

    assert EngineConfig(quantization="compressed-tensors").quantization == "compressed-tensors"
    with pytest.raises(ValueError, match=r"--quantization must be one of awq, gptq, fp8, int8, compressed-tensors, "
                                         r"got 'nf4'"):
        EngineConfig(quantization="nf4")


def test_row_parallel_split_must_align_with_groups(checkpoints, monkeypatch):
    """o_proj has 64 inputs: 4 ranks hold 16 each, which a group of 32 cannot divide."""
    quant, _ = checkpoints("awq")
    monkeypatch.setattr(distributed, "_STATE", distributed.ParallelState(rank=0, world_size=4, tp_size=4))
    with pytest.raises(ValueError, match=r"AWQ group size 32 does not divide this rank's 16 input features \(64 over "
                                         r"4 ranks\): lower --tensor-parallel-size"):
        build_model(_config(quant), quant, "dummy", torch.float32, torch.device("cpu"))


# ---- dummy weights and the memory planner ---------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["awq", "gptq", "fp8", "int8"])
def test_dummy_quantized_weights_are_valid_and_finite(tiny_model, flag):
    folder = tiny_model("llama", hidden_size=128, intermediate_size=256)  # group 128 divides every input size
    cfg = _config(folder)
    model = build_model(cfg, folder, "dummy", torch.float32, torch.device("cpu"), quantization=flag)
    assert model.quant_config.kind == flag
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 256)
    y = layer(x)
    assert torch.isfinite(y).all() and 0.05 < float(y.std()) < 5  # weights of std ~0.02 over 256 inputs
    ref = torch.nn.functional.linear(x, _dequantized(layer))
    torch.testing.assert_close(y, ref, **({} if flag in ("awq", "gptq") else dict(atol=0.05, rtol=0.05)))


def _dequantized(layer) -> torch.Tensor:
    from vserve.kernels.w4a16_ref import dequantize_weight

    m = layer.quant_method
    if hasattr(m, "tensors"):
        return dequantize_weight(*m.tensors(layer), m.cfg.layout, m.cfg.bits, m.group_size)
    return layer.weight.float() * layer.weight_scale


def test_dummy_load_reads_the_quantization_config_from_config_json(checkpoints):
    """The 8B-shape speed runs: config.json with a quantization_config and --load-format dummy."""
    quant, _ = checkpoints("gptq4-act-order")
    assert len(_greedy(quant, load_format="dummy")[0]) == NEW_TOKENS


@pytest.mark.parametrize("name", ["awq", "gptq4-act-order", "ct-w4a16-pack", "ct-w8a16-pack", "ct-fp8-w8a8",
                                  "vllm-fp8"])
@pytest.mark.parametrize("tp", [1, 2])
def test_planner_counts_the_loaded_weight_bytes_exactly(checkpoints, monkeypatch, name, tp):
    quant, _ = checkpoints(name)
    cfg = _config(quant)
    if tp > 1:  # rank 0's shard: the same construction a TP worker runs
        monkeypatch.setattr(distributed, "_STATE", distributed.ParallelState(rank=0, world_size=tp, tp_size=tp))
    model = build_model(cfg, quant, "dummy", torch.float32, torch.device("cpu"))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights_bytes(cfg, 4, model.quant_config, tp) == held


def test_the_engine_passes_the_flag_and_plans_with_the_loaded_layout(checkpoints, tiny_model):
    """Through LLM: --quantization reaches the loader (a contradiction is refused, dummy weights follow the
    flag), and the engine's memory plan counts the loaded layout's bytes."""
    from vserve import LLM

    quant, _ = checkpoints("awq")
    with pytest.raises(ValueError, match="--quantization gptq contradicts the checkpoint"):
        LLM(str(quant), dtype="float32", device="cpu", quantization="gptq")
    folder = tiny_model("llama", hidden_size=128, intermediate_size=256)
    llm = LLM(str(folder), dtype="float32", device="cpu", load_format="dummy", quantization="awq")
    engine = llm.llm_engine
    assert engine.core.model.quant_config.kind == "awq"
    assert engine.core.memory_plan.quantization is not None
    held = sum(p.numel() * p.element_size() for p in engine.core.model.parameters())  # buffers (RoPE tables) aside
    assert engine.core.memory_plan.weights_bytes == held
