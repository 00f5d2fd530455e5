"""`vserve quantize` on a device (issue #31): --device plumbing (on this CPU; CUDA is not faked), the CPU's
calibration defaults and their line, the progress bar's time left, the staged layer forward, GPTQ's one sweep per
group of linears."""

import pytest
import torch
from typer.testing import CliRunner

from vserve.cli.main import app
from vserve.quantize.options import CALIBRATION_DEFAULTS, QuantizeOptions

runner = CliRunner()
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's behaviour")
CPU_N, CPU_L = CALIBRATION_DEFAULTS["cpu"]


def invoke(*args: str, progress: bool = False):
    return runner.invoke(app, list(args), env={"VSERVE_NO_PROGRESS": "0" if progress else "1"})


def _summary(stdout: str) -> dict[str, str]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.replace("│", "|").split("|") if c.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


@NO_CUDA
def test_device_auto_picks_the_cpu_here_and_cuda_is_refused_in_one_line(tmp_path):
    from vserve.quantize.pipeline import compute_for, resolve_device

    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    assert compute_for(torch.device("cpu")).dtype == torch.float32  # the forwards stay float32 on a CPU
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=rf"^--device {name}: torch sees no CUDA device"):
            resolve_device(name)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu"])
def test_a_bad_device_is_refused_before_loading(tmp_path, device):
    res = invoke("quantize", str(tmp_path / "no-model"), "--method", "awq", "--device", device,
                 "-o", str(tmp_path / "out"))
    assert (res.exit_code, res.stderr.splitlines()) == (2, [
        f"error: --device must be auto, cpu, cuda or cuda:N, got {device!r}"])


@NO_CUDA
def test_cuda_without_a_gpu_exits_2_with_one_line(tiny_model, tmp_path):
    res = invoke("quantize", str(tiny_model("llama")), "--method", "rtn", "--group-size", "32", "--device", "cuda",
                 "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    assert res.stderr.splitlines() == ["error: --device cuda: torch sees no CUDA device (torch.cuda.is_available() "
                                       "is False); use --device cpu"]
    assert not (tmp_path / "out").exists()


def test_calibration_defaults_by_device_and_given_flags_win(tmp_path):
    opts = QuantizeOptions(method="awq", output_dir=tmp_path / "a")
    opts.validate()
    note = opts.fill_calibration("cpu")
    assert (opts.num_samples, opts.seq_len) == (CPU_N, CPU_L)
    assert note == (f"CPU: {CPU_N} x {CPU_L} calibration tokens (override with --num-samples/--seq-len; 128 x 512 "
                    "on a GPU)")
    gpu = QuantizeOptions(method="gptq", output_dir=tmp_path / "b")
    assert gpu.fill_calibration("cuda") is None and (gpu.num_samples, gpu.seq_len) == (128, 512)
    given = QuantizeOptions(method="awq", output_dir=tmp_path / "c", num_samples=7, seq_len=33)
    assert given.fill_calibration("cpu") is None and (given.num_samples, given.seq_len) == (7, 33)
    half = QuantizeOptions(method="awq", output_dir=tmp_path / "d", num_samples=7)
    assert half.fill_calibration("cpu").startswith(f"CPU: 7 x {CPU_L} calibration tokens")
    rtn = QuantizeOptions(method="rtn", output_dir=tmp_path / "e")
    assert rtn.fill_calibration("cpu") is None  # nothing to calibrate, nothing to say


@NO_CUDA
def test_cpu_default_is_said_on_stderr_and_in_the_summary_with_the_eta_bar(tiny_model, tmp_path):
    res = invoke("quantize", str(tiny_model("llama")), "--method", "gptq", "--group-size", "32", "-o",
                 str(tmp_path / "out"), progress=True)
    assert res.exit_code == 0, res.output
    assert f"CPU: {CPU_N} x {CPU_L} calibration tokens (override with --num-samples/--seq-len" in res.stderr
    rows = _summary(res.stdout)
    assert rows["calibration"].startswith(f"{CPU_N} x {CPU_L} tokens of shakespeare (the CPU default")
    assert rows["device"].startswith("cpu, float32 forwards")
    # the bar counts layers x groups and shows the time left
    assert "layer 2/2 done" in res.stderr and "ETA" in res.stderr and "Quantizing (GPTQ W4A16 g32" in res.stderr


def test_device_cpu_is_honoured_and_given_calibration_is_not_a_default(tiny_model, tmp_path):
    res = invoke("quantize", str(tiny_model("llama")), "--method", "awq", "--group-size", "32", "--device", "cpu",
                 "--num-samples", "4", "--seq-len", "32", "-o", str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    rows = _summary(res.stdout)
    assert rows["device"].startswith("cpu, float32 forwards")
    assert rows["calibration"] == "4 x 32 tokens of shakespeare"
    assert "CPU:" not in res.stderr


def test_the_staged_forward_is_the_layer_forward_and_a_foreign_layer_is_refused(tiny_model):
    from transformers import AutoModelForCausalLM

    from vserve.quantize.pipeline import _layer_output, check_stages, first_layer_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    layer = model.model.layers[0]
    ids = torch.randint(3, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        xs, kwargs = first_layer_inputs(model, layer, ids)
        x = xs[0]
        torch.testing.assert_close(_layer_output(layer, x, kwargs), layer(x, **kwargs), rtol=1e-6, atol=1e-6)
        check_stages(layer, x, kwargs)
        plain = type(layer).forward
        layer.forward = lambda *a, **k: 2 * plain(layer, *a, **k)  # a layer that is not x + attn, then + mlp
        with pytest.raises(ValueError, match="supports Llama-like layers only"):
            check_stages(layer, x, kwargs)


def test_one_gptq_sweep_over_stacked_linears_is_one_sweep_per_linear():
    """GPTQ treats the rows of a weight independently given H, so q/k/v (or gate/up) go through one sweep."""
    from vserve.quantize.gptq import hessian, quantize_gptq

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated inputs
    H = hessian(x)
    a, b = torch.randn(48, 64, generator=g), torch.randn(16, 64, generator=g)
    for act_order in (False, True):
        both = quantize_gptq(torch.cat([a, b]), H, 4, 32, act_order=act_order)
        for rows, w in ((slice(0, 48), a), (slice(48, 64), b)):
            alone = quantize_gptq(w, H, 4, 32, act_order=act_order)
            assert torch.equal(both[0][rows], alone[0]) and torch.equal(both[1][rows], alone[1])
            torch.testing.assert_close(both[2][rows], alone[2], rtol=1e-6, atol=0)
            assert torch.equal(both[3], alone[3])


def test_search_dtype_swap_restores_the_parameters():
    from vserve.quantize.pipeline import _dtype

    lin = torch.nn.Linear(8, 4)
    w, ptr = lin.weight.detach().clone(), lin.weight.data_ptr()
    with _dtype(lin, torch.bfloat16):
        assert lin.weight.dtype == lin.bias.dtype == torch.bfloat16
    assert lin.weight.data_ptr() == ptr and torch.equal(lin.weight, w) and lin.bias.dtype == torch.float32


def test_fake_quantize_is_rtn_then_dequantize_bit_for_bit():
    """AWQ's grid and clipping call fake_quantize about 30 times per group: it skips the int codes and the g_idx
    gather, and must still give exactly the numbers the stored tensors dequantize to."""
    from vserve.quantize.rtn import dequantize, fake_quantize, group_index, quantize_rtn

    g = torch.Generator().manual_seed(0)
    for bits, group in ((4, 32), (4, 64), (8, 128)):
        w = torch.randn(48, 256, generator=g) * torch.rand(1, 256, generator=g) * 3
        w[0, :group] = 0  # an all-zero group
        ref = dequantize(*quantize_rtn(w, bits, group), group_index(256, group))
        assert torch.equal(fake_quantize(w, bits, group), ref)
