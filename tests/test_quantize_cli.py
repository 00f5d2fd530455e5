"""`vserve quantize` end to end on a tiny random Llama: each method's folder (config, tensor dtypes and shapes,
tokenizer files), its dequantized weights and outputs close to the float model's, the summary, one-line errors."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from vserve.cli.main import app
from vserve.quantize.checkpoint import awq_config, compressed_tensors_config, gptq_config
from vserve.quantize.emulate import load_fake_quantized

runner = CliRunner()
GROUP = 32  # the tiny model's hidden size is 64
SERVING = importlib.util.find_spec("vserve.core.layers.quantization") is not None
needs_serving = pytest.mark.skipif(not SERVING, reason="serving quantized checkpoints (core/layers/quantization.py) "
                                   "is not in this tree yet")
CASES = {  # name: extra CLI args
    "awq": ["--method", "awq"],
    "gptq": ["--method", "gptq"],
    "gptq-sym-act-order": ["--method", "gptq", "--sym", "--desc-act"],
    "gptq-8bit": ["--method", "gptq", "--bits", "8"],
    "rtn": ["--method", "rtn"],
    "rtn-8bit": ["--method", "rtn", "--bits", "8"],
    "fp8": ["--method", "fp8"],
    "int8": ["--method", "int8"],
    "int8-w8a16": ["--method", "int8", "--weight-only"],
    "fp8-gptq": ["--method", "fp8", "--gptq"],
    "int8-gptq": ["--method", "int8", "--gptq", "--desc-act"],
}
_DONE: dict = {}


def invoke(*args: str, progress: bool = False):
    return runner.invoke(app, list(args), env={"VSERVE_NO_PROGRESS": "0" if progress else "1"})


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory):
    """quantized(case) -> (float folder, quantized folder, CLI result); each case is run once."""
    src = tiny_model("llama")

    def run(case: str):
        if case not in _DONE:
            out = tmp_path_factory.mktemp("q") / case
            res = invoke("quantize", str(src), *CASES[case], "--group-size", str(GROUP), "--num-samples", "8",
                         "--seq-len", "64", "--output-dir", str(out))
            assert res.exit_code == 0, res.output
            _DONE[case] = (src, out, res)
        return _DONE[case]

    return run


def _float_weights(src):
    return load_file(str(src / "model.safetensors"))


def _tokens() -> torch.Tensor:
    return torch.randint(3, 49152, (2, 24), generator=torch.Generator().manual_seed(0))


def _relative_logit_error(src, out) -> float:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    fake = load_fake_quantized(out)
    with torch.inference_mode():
        a, b = ref(_tokens()).logits, fake(_tokens()).logits
    return ((a - b).norm() / a.norm()).item()


def test_awq_folder_is_autoawq_gemm_and_keeps_the_float_function(quantized):
    src, out, res = quantized("awq")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == awq_config(GROUP) == {
        "quant_method": "awq", "zero_point": True, "group_size": GROUP, "bits": 4, "version": "gemm",
        "modules_to_not_convert": None}
    assert cfg["torch_dtype"] == "float16"
    t = load_file(str(out / "model.safetensors"))
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "mlp.down_proj": (64, 128)}  # (out, in)
    for name, (o, i) in shapes.items():
        p = f"model.layers.1.{name}"
        assert (t[p + ".qweight"].dtype, tuple(t[p + ".qweight"].shape)) == (torch.int32, (i, o // 8))
        assert (t[p + ".qzeros"].dtype, tuple(t[p + ".qzeros"].shape)) == (torch.int32, (i // GROUP, o // 8))
        assert (t[p + ".scales"].dtype, tuple(t[p + ".scales"].shape)) == (torch.float16, (i // GROUP, o))
        assert p + ".weight" not in t
    assert t["lm_head.weight"].dtype == torch.float16 and t["model.embed_tokens.weight"].dtype == torch.float16
    w = _float_weights(src)
    # The scales were folded into the norms: the stored norm weights moved, the function did not.
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(t[norm].float(), w[norm])
    # This random model (weights of std 0.2) amplifies errors: RTN's relative logit error is about 0.4 here.
    assert _relative_logit_error(src, out) < 0.6
    assert "AWQ alpha" in res.stdout
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()


@pytest.mark.parametrize("case", ["gptq", "gptq-sym-act-order", "gptq-8bit"])
def test_gptq_folder_layout_and_error(quantized, case):
    src, out, _ = quantized(case)
    bits = 8 if case == "gptq-8bit" else 4
    sym, desc_act = case == "gptq-sym-act-order", case == "gptq-sym-act-order"
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg == gptq_config(bits, GROUP, sym, desc_act)
    assert (cfg["quant_method"], cfg["bits"], cfg["sym"], cfg["desc_act"], cfg["checkpoint_format"]) == (
        "gptq", bits, sym, desc_act, "gptq")
    t = load_file(str(out / "model.safetensors"))
    p = "model.layers.0.mlp.down_proj"  # in 128, out 64
    assert (t[p + ".qweight"].dtype, tuple(t[p + ".qweight"].shape)) == (torch.int32, (128 * bits // 32, 64))
    assert tuple(t[p + ".qzeros"].shape) == (128 // GROUP, 64 * bits // 32)
    assert (t[p + ".scales"].dtype, tuple(t[p + ".scales"].shape)) == (torch.float16, (128 // GROUP, 64))
    g_idx = t[p + ".g_idx"]
    assert g_idx.dtype == torch.int32 and sorted(g_idx.tolist()) == [i // GROUP for i in range(128)]
    assert (g_idx.tolist() != sorted(g_idx.tolist())) == desc_act  # act-order permutes the groups
    from vserve.quantize.formats import dequantize_gptq

    w = _float_weights(src)[p + ".weight"]
    deq = dequantize_gptq(t[p + ".qweight"], t[p + ".qzeros"], t[p + ".scales"], g_idx, bits)
    assert ((deq - w).norm() / w.norm()).item() < (0.02 if bits == 8 else 0.2)
    assert _relative_logit_error(src, out) < (0.05 if bits == 8 else 0.6)  # RTN's: about 0.4 (4-bit), 0.03


@pytest.mark.parametrize("case", ["rtn", "rtn-8bit"])
def test_rtn_dequantized_weights_are_within_half_a_step(quantized, case):
    from vserve.quantize.formats import dequantize_awq, dequantize_gptq, unpack_awq, unpack_gptq

    src, out, res = quantized(case)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    t, w = load_file(str(out / "model.safetensors")), _float_weights(src)
    assert "calibration │ none needed" in res.stdout.replace("  ", " ") or "none needed" in res.stdout
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        if case == "rtn":  # 4-bit: the AutoAWQ GEMM layout, as AWQ
            assert cfg == awq_config(GROUP)
            deq = dequantize_awq(t[name + ".qweight"], t[name + ".qzeros"], t[name + ".scales"], GROUP)
            step = unpack_awq(t[name + ".qweight"], t[name + ".qzeros"], t[name + ".scales"])[2].float()
        else:  # 8-bit: the GPTQ layout, desc_act off
            assert cfg == gptq_config(8, GROUP, False, False)
            args = (t[name + ".qweight"], t[name + ".qzeros"], t[name + ".scales"], t[name + ".g_idx"])
            deq = dequantize_gptq(*args, bits=8)
            step = unpack_gptq(*args, bits=8)[2].float()
        step = step.repeat_interleave(GROUP, dim=1)
        # half a step, plus the fp16 rounding of the scale times at most 2^bits - 1 steps
        assert bool(((deq - w[name + ".weight"]).abs() <= step * (0.5 + 255 * 2**-11)).all())


@pytest.mark.parametrize("case", ["fp8", "int8", "int8-w8a16"])
def test_w8_folders_are_compressed_tensors(quantized, case):
    from vserve.quantize.w8a8 import unpack_int8

    src, out, _ = quantized(case)
    kind, weight_only = case[:4] if case == "int8-w8a16" else case, case == "int8-w8a16"
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc == compressed_tensors_config(kind, weight_only) and cfg["torch_dtype"] == "bfloat16"
    group = qc["config_groups"]["group_0"]
    ctype = "float" if kind == "fp8" else "int"
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    assert qc["format"] == {"fp8": "float-quantized", "int8": "int-quantized"}[kind] if not weight_only \
        else qc["format"] == "pack-quantized"
    assert group["targets"] == ["Linear"]
    assert group["weights"] == {"num_bits": 8, "type": ctype, "symmetric": True, "group_size": None,
                                "strategy": "channel", "dynamic": False}
    assert group["input_activations"] == (None if weight_only else {
        "num_bits": 8, "type": ctype, "symmetric": True, "group_size": None, "strategy": "token", "dynamic": True})
    t = load_file(str(out / "model.safetensors"))
    p = "model.layers.0.mlp.up_proj"  # out 128, in 64
    assert (t[p + ".weight_scale"].dtype, tuple(t[p + ".weight_scale"].shape)) == (torch.float32, (128, 1))
    if weight_only:
        assert (t[p + ".weight_packed"].dtype, tuple(t[p + ".weight_packed"].shape)) == (torch.int32, (128, 16))
        assert t[p + ".weight_shape"].tolist() == [128, 64]
        q = unpack_int8(t[p + ".weight_packed"])
    else:
        q = t[p + ".weight"]
        assert (q.dtype, tuple(q.shape)) == ({"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kind], (128, 64))
    if kind == "fp8" or weight_only:  # no smoothing: the stored weight is the float weight, per-channel quantized
        w = _float_weights(src)[p + ".weight"]
        deq = q.float() * t[p + ".weight_scale"]
        rel = 2**-4 if kind == "fp8" else 0.5 / 127  # e4m3's 3 mantissa bits; int8's half step of max|w|
        assert bool(((deq - w).abs() <= rel * w.abs().amax(dim=1, keepdim=True) + 1e-6).all())
    # measured about 0.18 (fp8: 3 mantissa bits), 0.05 (int8 W8A8), 0.03 (W8A16)
    assert _relative_logit_error(src, out) < {"fp8": 0.3, "int8": 0.1, "int8-w8a16": 0.05}[case]


def test_summary_and_progress_bar(tiny_model, tmp_path):
    out = tmp_path / "rtn"
    res = invoke("quantize", str(tiny_model("llama")), "--method", "rtn", "--group-size", "32", "-o", str(out),
                 progress=True)
    assert res.exit_code == 0, res.output
    assert "Quantizing (RTN W4A16 g32, AutoAWQ GEMM)" in res.stderr and "2/2" in res.stderr
    assert "Quantized: RTN W4A16 g32, AutoAWQ GEMM" in res.stdout
    assert "2 decoder layers, 14 linears quantized" in res.stdout
    assert " MiB -> " in res.stdout and "x smaller" in res.stdout and " s" in res.stdout
    again = invoke("quantize", str(tiny_model("llama")), "--method", "rtn", "--group-size", "32", "-o", str(out))
    assert again.exit_code == 2
    assert again.stderr.splitlines() == [f"error: --output-dir {str(out)!r} is not empty (pass --overwrite to "
                                         "replace it)"]


@pytest.mark.parametrize("args, message", [
    (["--method", "awq4"], "--method must be one of awq, gptq, rtn, fp8, int8, got 'awq4'"),
    (["--method", "awq", "--bits", "8"], "--method awq takes --bits 4 (the AutoAWQ GEMM layout is 4-bit), got 8"),
    (["--method", "fp8", "--bits", "4"], "--method fp8 takes --bits 8 (FP8 is 8-bit), got 4"),
    (["--method", "gptq", "--bits", "3"], "--method gptq takes --bits 4 or 8 (GPTQ packs 4 or 8 bits), got 3"),
    (["--method", "rtn", "--weight-only"], "--weight-only applies to --method fp8 or int8 (AWQ, GPTQ and RTN are "
                                           "weight-only already), got --method rtn"),
    (["--method", "gptq", "--backend", "autoawq"], "--backend autoawq quantizes with --method awq only, got "
                                                   "--method gptq"),
    (["--method", "int8", "--smoothquant-alpha", "1.5"], "--smoothquant-alpha must be in [0, 1], got 1.5"),
    (["--method", "fp8", "--desc-act"], "--desc-act applies to --method gptq (or fp8 / int8 with --gptq) only"),
    (["--method", "int8", "--sym"], "--sym applies to --method gptq only"),
    (["--method", "awq", "--gptq"], "--gptq applies to --method fp8 or int8 (for 4-bit GPTQ use --method gptq), got "
                                    "--method awq"),
])
def test_bad_flags_exit_2_with_one_line_before_loading(tmp_path, args, message):
    res = invoke("quantize", str(tmp_path / "no-model"), *args, "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [f"error: {message}"]
    assert "Traceback" not in res.output


def test_bad_model_and_group_size_exit_2_with_one_line(tiny_model, tmp_path):
    missing = tmp_path / "no-model"
    res = invoke("quantize", str(missing), "--method", "rtn", "-o", str(tmp_path / "a"))
    assert (res.exit_code, res.stderr.splitlines()) == (2, [
        f"error: model path {str(missing)!r} does not exist"])
    res = invoke("quantize", str(tiny_model("llama")), "--method", "gptq", "--group-size", "48", "-o",
                 str(tmp_path / "b"))
    assert (res.exit_code, res.stderr.splitlines()) == (2, [
        "error: --group-size 48 must divide every linear's input size (64, 128); try --group-size 64 or 32"])
    res = invoke("quantize", str(tiny_model("llama")), "--method", "awq", "--calib-data", str(tmp_path / "x.txt"),
                 "--group-size", "32", "-o", str(tmp_path / "c"))
    assert (res.exit_code, res.stderr.splitlines()) == (2, [
        f"error: --calib-data must be a .txt or .jsonl file or 'shakespeare', got {str(tmp_path / 'x.txt')!r} "
        "(no such file)"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


@pytest.mark.skipif(importlib.util.find_spec("awq") is not None, reason="AutoAWQ is installed here")
def test_autoawq_backend_without_autoawq_says_how_to_install(tiny_model, tmp_path):
    from vserve.quantize.autoawq import INSTALL_HINT

    res = invoke("quantize", str(tiny_model("llama")), "--method", "awq", "--backend", "autoawq", "--group-size",
                 "32", "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [f"error: {INSTALL_HINT}"]


def test_bench_perplexity_reads_a_quantized_folder(quantized):
    src, out, _ = quantized("awq")
    res = invoke("bench", "perplexity", str(out), "--max-tokens", "300", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    base = json.loads(invoke("bench", "perplexity", str(src), "--max-tokens", "300", "--json").stdout)
    assert r["quantization"] == "awq" and base["quantization"] is None and r["tokens"] == base["tokens"] == 299
    assert r["perplexity"] == pytest.approx(base["perplexity"], rel=0.2) and r["perplexity"] != base["perplexity"]


def _emulated_greedy(folder, prompt: list[int], n: int) -> list[int]:
    model = load_fake_quantized(folder)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@needs_serving
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_tiny_model_loads_and_generates_in_vserve(quantized, case):
    from vserve import LLM, SamplingParams

    _, out, _ = quantized(case)
    prompt = [5, 17, 99, 1234, 42]
    llm = LLM(str(out), dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=64,
              num_kv_blocks=8)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == _emulated_greedy(out, prompt, 6)


def test_quantize_help_imports_no_torch():
    code = """
import sys
from vserve.cli.main import app
try:
    app(["quantize", "--help"], prog_name="vserve")
except SystemExit as e:
    assert e.code == 0, e.code
assert "torch" not in sys.modules, "torch was imported"
"""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "--calib-data" in res.stdout and "--weight-only" in res.stdout


def test_the_embedded_default_model_quantizes_when_no_model_is_given(default_model_dir, tmp_path):
    out = tmp_path / "smollm2-fp8"
    res = invoke("quantize", "--method", "fp8", "-o", str(out))
    assert res.exit_code == 0, res.output
    assert "30 decoder layers, 210 linears quantized" in res.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 576 and cfg["quantization_config"]["format"] == "float-quantized"
    t = load_file(str(out / "model.safetensors"))
    assert t["model.layers.29.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(t["model.layers.29.mlp.down_proj.weight"].shape) == (576, 1536)
    assert "lm_head.weight" not in t  # tied to the embeddings
    assert (out / "tokenizer.json").read_bytes() == (default_model_dir / "tokenizer.json").read_bytes()
