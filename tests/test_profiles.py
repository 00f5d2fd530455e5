"""GPU profiles: shipped YAMLs validate, bad ones fail naming file/key/value, detection matches (faked GPUs),
recommendations fit the planner and agree with the seeds, and --profile merges below flags with sources."""

import json
import os
import subprocess
import sys
import types

import pytest
import yaml
from typer.testing import CliRunner

from vserve.cli.main import app
from vserve.core.config import EngineConfig
from vserve.core.memory import GiB, MiB, num_params, plan_memory
from vserve.ops.model_shapes import known_shape
from vserve.profiles import PROFILES_DIR, all_profiles, detect, get_profile, load_profile, profile_names, size_class
from vserve.profiles.detect import GpuInfo, match_profile, resolve_profile
from vserve.profiles.settings import profile_settings

runner = CliRunner()
ISSUE_PROFILES = {"a10g", "l4", "l40s", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "rtx4090", "mi250"}
# a representative published shape per size class
REPRESENTATIVE = {"8b": "llama-3.1-8b", "14b": "qwen2.5-14b", "34b": "yi-34b", "72b": "llama-2-70b",
                  "moe": "mixtral-8x7b"}


def test_every_issue_gpu_has_a_profile_and_all_validate():
    assert ISSUE_PROFILES <= set(profile_names())
    for p in all_profiles():
        assert p.name == os.path.splitext(os.path.basename(p.path))[0]
        assert p.fp8 == (p.dense_tflops["fp8"] is not None)
        assert p.datasheet.startswith("https://")


def test_planning_memory_keeps_the_gddr_ecc_reserve():
    assert get_profile("a10g").memory_bytes == 24 * GiB * 15 // 16  # an A10G shows 22.5 GiB
    assert get_profile("rtx4090").memory_bytes == 24 * GiB  # no ECC
    assert get_profile("h200").memory_bytes == 141 * GiB  # HBM's ECC costs no capacity


def _write(tmp_path, name: str, data: dict):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["engine"].update(gpu_memory_utilization=1.5),
     "engine.gpu_memory_utilization must be in (0, 1], got 1.5"),
    (lambda d: d["engine"].update(block_size=24), "engine.block_size must be one of 16, 32, 64, 128, 256, got 24"),
    (lambda d: d.update(vendor="intel"), "vendor must be nvidia or amd, got 'intel'"),
    (lambda d: d["models"]["34b"].update(quantization="q3"), "models.34b.quantization must be null or one of "
                                                             "awq, gptq, fp8, int8, got 'q3'"),
    (lambda d: d["models"]["72b"].update(tensor_parallel_size=3), "models.72b.tensor_parallel_size must be a power "
                                                                  "of two >= 1, got 3"),
    (lambda d: d.pop("memory_gb"), "memory_gb is missing"),
    (lambda d: d.update(memory_gb="24GB"), "memory_gb must be a number > 0, got '24GB'"),
    (lambda d: d.update(colour="green"), "colour is not a known key"),
    (lambda d: d.update(match=["(unclosed"]), "match must be a non-empty list of regular expressions, "
                                              "got ['(unclosed']"),
    (lambda d: d.update(fp8=True), "fp8 must agree with dense_tflops.fp8 (None), got True"),
    (lambda d: d["dense_tflops"].update(bf16=-1), "dense_tflops.bf16 must be null or a number > 0, got -1"),
])
def test_a_bad_profile_fails_with_one_error_naming_file_key_and_value(tmp_path, edit, message):
    data = yaml.safe_load((PROFILES_DIR / "a10g.yaml").read_text())
    edit(data)
    path = _write(tmp_path, "a10g", data)
    with pytest.raises(ValueError) as e:
        load_profile(path)
    assert str(e.value).startswith(f"{path}: {message}")


def test_profile_name_must_match_its_file(tmp_path):
    data = yaml.safe_load((PROFILES_DIR / "l4.yaml").read_text())
    path = _write(tmp_path, "my-l4", data)
    with pytest.raises(ValueError, match=r"my-l4.yaml: name must be the file's name 'my-l4', got 'l4'"):
        load_profile(path)


@pytest.mark.parametrize(("shape", "cls"), [("smollm2-135m", "8b"), ("llama-3.1-8b", "8b"), ("qwen3-8b", "8b"),
                                            ("llama-2-13b", "14b"), ("qwen2.5-14b", "14b"), ("yi-34b", "34b"),
                                            ("qwen2.5-32b", "34b"), ("llama-2-70b", "72b"), ("qwen2.5-72b", "72b"),
                                            ("mixtral-8x7b", "moe")])
def test_size_class_of_published_models(shape, cls):
    m = known_shape(shape)
    assert size_class(num_params(m), moe=m.raw.get("num_local_experts") is not None) == cls


def test_no_class_beyond_72b():
    assert size_class(405_000_000_000) is None


@pytest.mark.parametrize("profile", profile_names())
def test_every_recommendation_fits_the_planner_at_4k_context(profile):
    p = get_profile(profile)
    for cls, shape in REPRESENTATIVE.items():
        rec = p.models[cls]
        plan = plan_memory(known_shape(shape), gpu_memory_bytes=p.memory_bytes, max_model_len=4096,
                           tensor_parallel_size=rec.tensor_parallel_size, quantization=rec.quantization, **p.engine)
        assert plan.verdict == "fits", (profile, cls, plan.reason)


def test_recommendations_agree_with_the_seeds():
    a10g = get_profile("a10g").models  # 7B-13B on one A10G
    assert a10g["8b"].tensor_parallel_size == a10g["14b"].tensor_parallel_size == 1
    a100 = get_profile("a100-80gb").models
    assert (a100["72b"].tensor_parallel_size, a100["72b"].quantization) == (2, None)  # 70B: 2 x A100-80G, TP2
    assert (a100["moe"].tensor_parallel_size, a100["moe"].quantization) == (4, None)  # Mixtral: 4 x A100-80G
    rtx = get_profile("rtx4090").models  # beyond 7B in FP16 a 4090 needs 8- or 4-bit
    assert all(rtx[c].quantization in ("fp8", "int8", "awq", "gptq") for c in ("8b", "14b", "34b", "72b", "moe"))


# ---- detection (faked GPUs) --------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "mib", "expected"), [
    ("NVIDIA A10G", 23028, "a10g"), ("NVIDIA A10", 23028, "a10"), ("NVIDIA L4", 23034, "l4"),
    ("NVIDIA L40S", 46068, "l40s"), ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"), ("NVIDIA A100 80GB PCIe", 81920, "a100-80gb"),
    ("NVIDIA H100 80GB HBM3", 81559, "h100-sxm"), ("NVIDIA H100 PCIe", 81559, "h100-pcie"),
    ("NVIDIA H100 NVL", 95830, "h100-nvl"), ("NVIDIA H200", 143771, "h200"),
    ("NVIDIA GeForce RTX 4090", 24564, "rtx4090"), ("AMD Instinct MI250X / MI250", 65520, "mi250"),
    ("AMD Instinct MI300X", 196592, "mi300x"),
])
def test_known_gpus_match_their_profile(name, mib, expected):
    gpu = GpuInfo(0, "amd" if name.startswith("AMD") else "nvidia", name, mib * MiB)
    assert match_profile(gpu) == (get_profile(expected), None)


def test_unknown_gpu_falls_back_to_the_nearest_profile_by_memory_with_a_warning():
    profile, warning = match_profile(GpuInfo(0, "nvidia", "NVIDIA RTX 6000 Ada Generation", 49140 * MiB))
    assert profile.name == "l40s"
    assert warning == ("unknown GPU 'NVIDIA RTX 6000 Ada Generation' (48.0 GiB): using the profile nearest by "
                       "memory, l40s (48 GB); pass --profile NAME to choose one")


def test_auto_uses_the_injected_gpus_and_refuses_none():
    assert resolve_profile("auto", gpus=[GpuInfo(0, "nvidia", "NVIDIA L4", 23034 * MiB)])[0].name == "l4"
    with pytest.raises(ValueError, match="--profile auto found no GPU"):
        resolve_profile("auto", gpus=[])


def test_unknown_gpu_warning_is_logged_once(caplog):
    gpus = (GpuInfo(0, "nvidia", "NVIDIA Quadro GV100", 32 * GiB),)
    with caplog.at_level("WARNING", logger="vserve.profiles"):
        first = profile_settings("auto", "llama-3.1-8b", gpus)
        profile_settings("auto", "llama-3.1-8b", gpus)
    assert [r.message for r in caplog.records].count(first.notes[0]) == 1
    assert first.profile.name == "a100-40gb" and first.size_class == "8b"


def fake_pynvml() -> types.SimpleNamespace:
    """Enough of pynvml for nvml_report: two H100s with NVLink, one process on the second."""
    mem = {0: types.SimpleNamespace(total=81559 * MiB, used=GiB), 1: types.SimpleNamespace(total=81559 * MiB,
                                                                                              used=2 * GiB)}
    procs = {0: [], 1: [types.SimpleNamespace(pid=4242, usedGpuMemory=GiB)]}
    nv = types.SimpleNamespace(
        NVMLError=type("NVMLError", (Exception,), {}), NVML_NVLINK_MAX_LINKS=2, NVML_FEATURE_ENABLED=1,
        NVML_P2P_CAPS_INDEX_READ=0, NVML_P2P_STATUS_OK=0, shut=False,
        nvmlInit=lambda: None, nvmlSystemGetDriverVersion=lambda: "550.54.15",
        nvmlSystemGetCudaDriverVersion=lambda: 12040, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=mem.__getitem__, nvmlDeviceGetComputeRunningProcesses=procs.__getitem__,
        nvmlSystemGetProcessName=lambda pid: "python3", nvmlDeviceGetNvLinkState=lambda h, link: 1,
        nvmlDeviceGetP2PStatus=lambda a, b, cap: 0)
    nv.nvmlShutdown = lambda: setattr(nv, "shut", True)
    return nv


def test_nvml_report_reads_gpus_driver_processes_and_p2p(monkeypatch):
    fake = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    rep = detect.nvml_report()
    assert (rep.driver_version, rep.cuda_driver_version, rep.nvlink, rep.p2p) == ("550.54.15", "12.4", True,
                                                                                 {(0, 1): True})
    assert [(g.name, g.memory_bytes, g.used_bytes) for g in rep.gpus] == [
        ("NVIDIA H100 80GB HBM3", 81559 * MiB, GiB), ("NVIDIA H100 80GB HBM3", 81559 * MiB, 2 * GiB)]
    assert rep.gpus[1].processes == (detect.GpuProcess(4242, "python3", GiB),)
    assert fake.shut and rep.error is None


def test_nvml_missing_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    rep = detect.nvml_report()
    assert rep.gpus == [] and "nvidia-ml-py is not installed" in rep.error


def test_amd_gpus_from_rocm_smi_json(monkeypatch):
    out = json.dumps({"card0": {"Card Series": "AMD Instinct MI250X / MI250", "VRAM Total Memory (B)": "68702699520",
                                "VRAM Total Used Memory (B)": "10993664"}, "system": {"Driver version": "6.7"}})
    monkeypatch.setattr(detect.shutil, "which", lambda exe: "/opt/rocm/bin/rocm-smi")
    monkeypatch.setattr(detect.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=out))
    assert detect.rocm_gpus() == [GpuInfo(0, "amd", "AMD Instinct MI250X / MI250", 68702699520, 10993664)]


def test_amd_gpus_from_sysfs_without_rocm(tmp_path):
    for card, device, vram in (("card0", "0x740c", 64 * GiB), ("card1", "0x164e", 512 * MiB)):  # MI250, an iGPU
        dev = tmp_path / card / "device"
        dev.mkdir(parents=True)
        (dev / "vendor").write_text("0x1002\n")
        (dev / "device").write_text(device + "\n")
        (dev / "mem_info_vram_total").write_text(str(vram))
    assert detect._sysfs_amd_gpus(tmp_path) == [GpuInfo(0, "amd", "AMD Instinct MI250X / MI250", 64 * GiB)]


# ---- --profile in the engine config ------------------------------------------------------------------------

def test_flags_beat_profile_beat_defaults_with_sources():
    cfg = EngineConfig.resolve({"model": "llama-2-13b", "profile": "a10g", "max_num_seqs": 64})
    rows = {flag: (value, source) for flag, value, source in cfg.describe()}
    assert rows["--max-num-seqs"] == (64, "flag")
    assert rows["--max-num-batched-tokens"] == (4096, "profile a10g")
    assert rows["--block-size"] == (16, "profile a10g")
    assert rows["--enforce-eager"] == (False, "default")
    assert rows["--tensor-parallel-size"] == (1, "profile a10g")


def test_tp_recommendation_applies_and_quantization_recommendation_is_only_reported():
    """A quantization names a kind of checkpoint, not a setting: --quantization must match the checkpoint."""
    cfg = EngineConfig.resolve({"model": "llama-2-70b", "profile": "a10g"})
    assert (cfg.tensor_parallel_size, cfg.quantization) == (4, None)
    assert cfg.sources["tensor_parallel_size"] == "profile a10g"
    assert cfg.sources["quantization"] == "default (profile a10g recommends awq; serve a checkpoint quantized " \
                                          "with it)"


def test_profile_auto_detects_through_the_probe(monkeypatch):
    monkeypatch.setattr(detect, "detect_gpus", lambda: (GpuInfo(0, "nvidia", "NVIDIA H200", 143771 * MiB),))
    cfg = EngineConfig.resolve({"profile": "auto"})
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.sources["profile"]) == (512, 16384, "flag (h200)")


def test_bad_profile_name_is_a_flag_error():
    with pytest.raises(ValueError, match=r"^--profile must be auto or one of a10, .*, got 'b200'$"):
        EngineConfig.resolve({"profile": "b200"})


def test_print_config_shows_profile_sources():
    res = runner.invoke(app, ["generate", "--profile", "rtx4090", "--max-num-seqs", "8", "--print-config"],
                        env={"VSERVE_NO_PROGRESS": "1"})
    assert res.exit_code == 2  # no prompt: the table is printed first
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in res.stderr.splitlines() if line.startswith("│")}
    assert rows["--max-num-seqs"] == ["8", "flag"]
    assert rows["--max-num-batched-tokens"] == ["4096", "profile rtx4090"]
    assert rows["--profile"] == ["rtx4090", "flag"]


# ---- vserve profiles -----------------------------------------------------------------------------------------

def test_profiles_list_and_show_json():
    res = runner.invoke(app, ["profiles", "list", "--json"])
    assert res.exit_code == 0, res.output
    assert [p["name"] for p in json.loads(res.stdout)] == profile_names()
    res = runner.invoke(app, ["profiles", "show", "h200", "--json"])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.stdout)
    assert (shown["memory_gb"], shown["memory_bandwidth_gbps"], shown["dense_tflops"]["fp8"]) == (141, 4800, 1979)
    assert shown["models"]["72b"] == {"tensor_parallel_size": 1, "quantization": "fp8"}


def test_profiles_show_table_and_unknown_name():
    res = runner.invoke(app, ["profiles", "show", "a100-80gb"], env={"COLUMNS": "160"})
    assert res.exit_code == 0 and "2039 GB/s" in res.stdout and "By model size" in res.stdout
    res = runner.invoke(app, ["profiles", "show", "b200"])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [f"error: unknown GPU profile 'b200'; known: {', '.join(profile_names())}"]


def test_profiles_and_doctor_help_import_no_torch():
    code = """
import sys
from vserve.cli.main import app
for args in (["profiles", "list"], ["profiles", "show", "l4"], ["doctor", "--help"]):
    try:
        app(args, prog_name="vserve")
    except SystemExit as e:
        assert e.code == 0, (args, e.code)
assert "torch" not in sys.modules, "torch was imported"
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
