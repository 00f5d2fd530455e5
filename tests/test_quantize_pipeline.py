"""The pieces of `vserve quantize` below the CLI: scale folding keeps the float model's function, calibration
samples, 8-bit weight/activation quantization and its packing, SmoothQuant's benefit."""

import pytest
import torch
from safetensors.torch import load_file

from vserve.quantize.calibration import CALIBRATION_PLAYS, calibration_samples, calibration_text
from vserve.quantize.layers import decoder_layers, fold_scales, layer_groups
from vserve.quantize.smoothquant import smooth_scales
from vserve.quantize.w8a8 import (
    FP8_MAX,
    dequantize_weight,
    fake_quantize_activation,
    pack_int8,
    quantize_weight,
    unpack_int8,
)


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("kv_heads", [4, 2])  # 4: v and o have one shape, so v -> o is folded too (AWQ)
def test_folding_scales_into_the_preceding_module_keeps_the_float_model_output(tiny_model, kv_heads):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama", num_key_value_heads=kv_heads),
                                                 dtype=torch.float32).eval()
    ids = torch.randint(3, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    g = torch.Generator().manual_seed(1)
    _, layers = decoder_layers(model)
    folded = 0
    with torch.no_grad():
        for layer in layers:
            for group in layer_groups(layer, "awq"):
                if group.prev is None:
                    continue
                linears = [layer.get_submodule(n) for n in group.linears]
                s = torch.exp(torch.randn(linears[0].in_features, generator=g))  # scales over about e^-3 .. e^3
                fold_scales(layer.get_submodule(group.prev), linears, s)
                folded += 1
    assert folded == 2 * (4 if kv_heads == 4 else 3)
    after = _logits(model, ids)
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(64))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_awq_folder_dequantized_weights_unfolded_are_close_to_the_originals(tiny_model, tmp_path):
    """W_q / s, with s read back from the folded norm, is the original weight up to 4-bit error: the scale went
    into the norm in the right direction and the stored weights are W * s."""
    from typer.testing import CliRunner

    from vserve.cli.main import app
    from vserve.quantize.formats import dequantize_awq

    src = tiny_model("llama")
    out = tmp_path / "awq"
    res = CliRunner().invoke(app, ["quantize", str(src), "--method", "awq", "--group-size", "32", "--num-samples",
                                   "4", "--seq-len", "64", "-o", str(out)], env={"VSERVE_NO_PROGRESS": "1"})
    assert res.exit_code == 0, res.output
    w, t = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for norm, linear in (("input_layernorm", "self_attn.v_proj"), ("post_attention_layernorm", "mlp.up_proj")):
        p = "model.layers.1."
        s = w[p + norm + ".weight"] / t[p + norm + ".weight"].float()
        assert (s.max() / s.min()).item() > 1.1  # a real scale was searched, not all ones
        q = p + linear
        unfolded = dequantize_awq(t[q + ".qweight"], t[q + ".qzeros"], t[q + ".scales"], 32) / s
        orig = w[q + ".weight"]
        assert ((unfolded - orig).norm() / orig.norm()).item() < 0.15


def test_calibration_samples_are_disjoint_windows_in_text_order():
    ids = list(range(1000))
    x = calibration_samples(ids, num_samples=5, seq_len=64, seed=0)
    assert x.shape == (5, 64) and x.dtype == torch.long
    starts = x[:, 0].tolist()
    assert starts == sorted(starts) and all(s % 64 == 0 for s in starts)
    assert all(x[i].tolist() == list(range(s, s + 64)) for i, s in enumerate(starts))
    assert torch.equal(x, calibration_samples(ids, 5, 64, seed=0))
    assert not torch.equal(x, calibration_samples(ids, 5, 64, seed=1))
    assert calibration_samples(ids, num_samples=100, seq_len=64).shape == (15, 64)  # all the text holds
    with pytest.raises(ValueError, match="fewer than --seq-len 2000"):
        calibration_samples(ids, 4, 2000)


def test_calibration_text_is_comedies_not_hamlet_or_a_file(tmp_path):
    assert not any("hamlet" in play for play in CALIBRATION_PLAYS)
    text = calibration_text("shakespeare")
    assert "TWELFTH NIGHT" in text and "A MIDSUMMER NIGHT'S DREAM" in text
    assert "Hamlet" not in text and "Elsinore" not in text
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert calibration_text(str(f)) == "one\n\ntwo"
    f.write_text('{"text": "one"}\n{"txt": 2}\n')
    with pytest.raises(ValueError, match=r'c.jsonl:2: expected \{"text": "..."\}'):
        calibration_text(str(f))


def test_8bit_channel_weights_are_within_half_a_step_and_fp8_within_its_mantissa():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 3, 32)[:, None]
    q, scale = quantize_weight(w, "int8")
    assert q.dtype == torch.int8 and scale.shape == (32, 1)
    assert torch.equal(scale[:, 0], w.abs().amax(dim=1) / 127)
    assert bool(((dequantize_weight(q, scale) - w).abs() <= scale / 2 + 1e-7).all())
    q8, s8 = quantize_weight(w, "fp8")
    assert q8.dtype == torch.float8_e4m3fn and q8.float().abs().amax().item() == FP8_MAX
    assert bool(((dequantize_weight(q8, s8) - w).abs() <= w.abs() / 16 + s8 * 2**-9).all())


def test_per_token_activation_quantization_uses_one_scale_per_row():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(3)) * torch.tensor([0.01, 1.0, 100.0])[:, None,
                                                                                                           None]
    for kind, top in (("int8", 127), ("fp8", FP8_MAX)):
        y = fake_quantize_activation(x, kind)
        scale = x.abs().amax(dim=-1, keepdim=True) / top
        grid = y / scale
        if kind == "int8":
            torch.testing.assert_close(grid, grid.round(), atol=1e-3, rtol=0)  # every value on its row's grid
            assert bool(((y - x).abs() <= scale / 2 * 1.0001).all())
        else:
            assert bool(((y - x).abs() <= x.abs() / 16 + scale * 2**-9).all())
        torch.testing.assert_close(y.abs().amax(dim=-1), x.abs().amax(dim=-1))  # the row max is kept exactly


def test_int8_packs_like_compressed_tensors_pack_quantized():
    q = torch.tensor([[-128, -1, 0, 127, 5, 6, 7, 8]], dtype=torch.int8)
    packed = pack_int8(q)
    # element i -> byte i % 4 of int32 i // 4, stored as q + 128: [0, 127, 128, 255] -> 0xFF807F00
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == 0xFF807F00 - 2**32
    assert packed[0, 1].item() == (133 | 134 << 8 | 135 << 16 | 136 << 24) - 2**32
    assert torch.equal(unpack_int8(packed), q)


def test_smoothquant_lowers_w8a8_error_with_outlier_channels():
    g = torch.Generator().manual_seed(4)
    big = torch.ones(256)
    big[torch.randperm(256, generator=g)[:4]] = 50.0
    x = torch.randn(512, 256, generator=g) * big
    w = torch.randn(128, 256, generator=g)
    ref = x @ w.t()

    def w8a8(x, w):
        q, s = quantize_weight(w, "int8")
        return fake_quantize_activation(x, "int8") @ dequantize_weight(q, s).t()

    s = smooth_scales(x.abs().amax(dim=0), [w], alpha=0.5)
    plain = (w8a8(x, w) - ref).norm() / ref.norm()
    smoothed = (w8a8(x / s, w * s) - ref).norm() / ref.norm()
    assert smoothed < 0.5 * plain
    with pytest.raises(ValueError, match="must be in"):
        smooth_scales(x.abs().amax(dim=0), [w], alpha=1.5)
