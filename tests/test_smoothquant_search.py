"""SmoothQuant's per-group alpha search (`--smoothquant-alpha auto`): what it picks on hand-built inputs, that it
beats a fixed alpha on held-out calibration tokens, the flag's validation, and the folders it writes."""

import importlib.util
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from vserve.cli.main import app
from vserve.cli.quantize import _alphas
from vserve.quantize.options import QuantizeOptions
from vserve.quantize.smoothquant import ALPHAS, search_alpha, smooth_scales, w8a8_output

SERVING = importlib.util.find_spec("vserve.core.layers.quantization") is not None


def _error(x, weights, s, kind) -> float:
    w = torch.cat(weights)
    return (w8a8_output(x, w, s, kind) - x @ w.t()).pow(2).sum().item()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_search_keeps_no_smoothing_when_no_channel_stands_out(kind):
    """Every input channel has max |x| = 1 and max |w| = 1: each alpha's scales are all ones, so none wins the tie."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g)
    x = x / x.abs().amax(dim=0)
    w = torch.randn(96, 128, generator=g)
    w = w / w.abs().amax(dim=0)
    s, alpha = search_alpha(x, [w[:32], w[32:]], kind)
    assert alpha is None and torch.equal(s, torch.ones(128))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_search_smooths_an_outlier_channel_seen_on_some_tokens_better_than_alpha_half(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 256, generator=g)
    x[torch.rand(1024, generator=g) < 0.1, 7] *= 50  # one channel, 50x larger on a tenth of the tokens
    w = torch.randn(192, 256, generator=g)
    weights = [w[:64], w[64:]]
    s, alpha = search_alpha(x, weights, kind)
    assert alpha is not None and 0 < alpha < 1 and alpha != 0.5  # measured: 0.4 (int8), 0.55 (fp8)
    torch.testing.assert_close(s, smooth_scales(x.abs().amax(dim=0), weights, alpha))
    errors = {a: _error(x, weights, smooth_scales(x.abs().amax(dim=0), weights, a), kind) for a in ALPHAS}
    assert _error(x, weights, s, kind) == min(errors.values())
    # measured: 0.15 and 0.80 of no smoothing's and alpha 0.5's error (int8), 0.74 and 0.993 (fp8)
    assert _error(x, weights, s, kind) < {"int8": 0.2, "fp8": 0.85}[kind] * _error(x, weights, torch.ones(256), kind)
    assert _error(x, weights, s, kind) < {"int8": 0.9, "fp8": 1.0}[kind] * errors[0.5]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_searched_alpha_beats_half_and_none_on_all_the_calibration_inputs(tiny_model, kind):
    """The search sees a random quarter of the tokens entering q/k/v of a tiny Llama whose norm makes two outlier
    channels; its smoothing is at least as good as alpha 0.5 and as none on all of them."""
    from transformers import AutoModelForCausalLM

    from vserve.quantize.calibration import calibration_samples, calibration_token_ids
    from vserve.quantize.pipeline import first_layer_inputs

    src = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    layer = model.model.layers[0]
    with torch.inference_mode():
        layer.input_layernorm.weight.data[[3, 40]] *= 30
        samples = calibration_samples(calibration_token_ids(src, "shakespeare"), 8, 64, seed=0)
        xs, kwargs = first_layer_inputs(model, layer, samples)
        x = torch.cat([layer.input_layernorm(h) for h in xs]).reshape(-1, 64)  # what q/k/v see
        weights = [layer.get_submodule(f"self_attn.{n}_proj").weight for n in "qkv"]
        amax = x.abs().amax(dim=0)
        pick = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[: x.shape[0] // 4]
        s, alpha = search_alpha(x[pick], weights, kind, amax)
        chosen = _error(x, weights, s, kind)
        assert alpha is not None
        assert chosen <= _error(x, weights, smooth_scales(amax, weights, 0.5), kind)
        assert chosen < 0.5 * _error(x, weights, torch.ones(64), kind)


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="rtn", smoothquant_alpha=0.5), "--smoothquant-alpha applies to W8A8 only (--method fp8 or int8, "
     "without --weight-only: weight-only schemes keep their activations in 16 bits)"),
    (dict(method="int8", weight_only=True, smoothquant_alpha="auto"), "--smoothquant-alpha applies to W8A8 only"),
    (dict(method="fp8", smoothquant_alpha="half"), "--smoothquant-alpha must be a number in [0, 1] or auto, got "
     "'half'"),
    (dict(method="fp8", smoothquant_alpha="-0.1"), "--smoothquant-alpha must be in [0, 1], got -0.1"),
])
def test_smoothquant_alpha_is_refused_outside_w8a8_and_outside_0_1(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as e:
        QuantizeOptions(output_dir=tmp_path / "out", **kwargs).validate()
    assert str(e.value).startswith(message)


def test_smoothquant_alpha_defaults_auto_for_int8_w8a8_and_off_for_fp8(tmp_path):
    def opts(**kwargs):
        o = QuantizeOptions(output_dir=tmp_path / "out", **kwargs)
        o.validate()
        return o

    assert opts(method="int8").smoothquant_alpha == "auto"
    assert opts(method="int8").scheme == ("INT8 W8A8 SmoothQuant alpha auto, dynamic per-token activations, "
                                          "compressed-tensors")
    assert opts(method="int8", smoothquant_alpha="0.5").smoothquant_alpha == 0.5
    assert opts(method="int8", weight_only=True).smoothquant_alpha is None
    fp8 = opts(method="fp8")
    assert (fp8.smoothquant_alpha, fp8.needs_calibration) == (None, False)
    fp8 = opts(method="fp8", smoothquant_alpha="auto", gptq=True)
    assert fp8.needs_calibration
    assert fp8.scheme == ("FP8 W8A8 SmoothQuant alpha auto, GPTQ rounding, dynamic per-token activations, "
                          "compressed-tensors")
    assert opts(method="fp8", smoothquant_alpha=0.25).scheme.startswith("FP8 W8A8 SmoothQuant alpha 0.25,")
    fp8.validate()  # validating twice (the CLI, then the pipeline) keeps the choice
    assert fp8.smoothquant_alpha == "auto"


def test_summary_gives_the_mean_alpha_and_the_groups_left_unsmoothed():
    assert _alphas([0.5, None, 0.7]) == "mean 0.60 over 2 groups, 1 of 3 left unsmoothed"
    assert _alphas([0.25, 0.75]) == "mean 0.50 over 2 groups"
    assert _alphas([None, None]) == "all 2 groups left unsmoothed"


def _outlier_model(tiny_model, tmp_path):
    """The tiny Llama with two outlier channels in every norm, as trained LLMs have."""
    from transformers import AutoModelForCausalLM

    src = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 40]] *= 30
    folder = tmp_path / "outliers"
    model.save_pretrained(folder, safe_serialization=True)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.parametrize("args", [["--method", "int8"], ["--method", "fp8", "--smoothquant-alpha", "auto", "--gptq"]])
def test_auto_smoothed_folder_loads_generates_and_reports_its_alphas(tiny_model, tmp_path, args):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vserve.quantize.emulate import load_fake_quantized

    src, out = _outlier_model(tiny_model, tmp_path), tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(src), *args, "--num-samples", "8", "--seq-len", "64", "-o",
                                   str(out)], env={"VSERVE_NO_PROGRESS": "1"})
    assert res.exit_code == 0, res.output
    assert "SmoothQuant alpha auto" in res.stdout and "SmoothQuant alpha │ mean" in res.stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    w, t = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(t[norm].float(), w[norm], rtol=1e-2)  # a smoothing was folded into the norm
    ids = torch.randint(3, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    fake = load_fake_quantized(out)
    with torch.inference_mode():
        a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
        b = fake(ids).logits
    assert ((a - b).norm() / a.norm()).item() < 0.3
    if not SERVING:
        return
    from vserve import LLM, SamplingParams

    prompt = [5, 17, 99, 1234, 42]
    llm = LLM(str(out), dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=64, num_kv_blocks=8)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(6):
            ids = torch.cat([ids, fake(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got[0].outputs[0].token_ids == ids[0, len(prompt):].tolist()
