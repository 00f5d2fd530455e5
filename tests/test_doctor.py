"""`vserve doctor`'s fault matrix with injected probes (no GPU needed): each fault is found with the right fix,
the memory plan predicts OOM / tight with numbered remedies, and a healthy machine yields no failure."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from vserve.cli.main import app
from vserve.core.memory import GiB, MiB
from vserve.ops import probe
from vserve.ops.doctor import Environment, run_doctor
from vserve.profiles.detect import GpuInfo, GpuProcess

runner = CliRunner()
H100 = GpuInfo(0, "nvidia", "NVIDIA H100 80GB HBM3", 81559 * MiB, used_bytes=512 * MiB)
HEALTHY = Environment(
    gpus=[H100, replace(H100, index=1)], driver_version="570.124.06", cuda_driver_version="12.8",
    p2p={(0, 1): True}, nvlink=True, torch_version="2.9.0+cu128", torch_cuda="12.8", torch_gpu_count=2,
    torch_requires=['triton==3.5.0; platform_system == "Linux"', 'nvidia-nccl-cu12==2.28.9; platform_system == '
                    '"Linux"'],
    packages={"torch": "2.9.0+cu128", "triton": "3.5.0", "transformers": "5.25.0", "numpy": "2.3.5",
              "nvidia-nccl-cu12": "2.28.9"},
    nccl_version="2.28.9", env={}, net_interfaces=["eth0", "lo"], shm_bytes=32 * GiB, triton=(True, "ok"))
A10G = GpuInfo(0, "nvidia", "NVIDIA A10G", 23028 * MiB, used_bytes=300 * MiB)
RTX4090 = GpuInfo(0, "nvidia", "NVIDIA GeForce RTX 4090", 24564 * MiB, used_bytes=400 * MiB)


def statuses(report) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_healthy_machine_yields_no_failure(tp):
    report = run_doctor(HEALTHY, model="llama-3.1-8b", tensor_parallel_size=tp, max_model_len=8192)
    assert set(statuses(report).values()) <= {"ok", "skip"}, [vars(c) for c in report.checks if c.status != "ok"]
    assert report.healthy and report.exit_code == 0
    assert report.plan.verdict == "fits" and report.remedies == []


FAULTS = [
    # (what, environment change, tensor-parallel size, check, status, words of the fix)
    ("no GPU", dict(gpus=[], torch_cuda=None, torch_gpu_count=0, nccl_version=None, triton=None,
                    nvml_error="NVML Shared Library Not Found"), 1, "GPU", "fail", "install the NVIDIA driver"),
    ("GPUs hidden", dict(gpus=[], torch_gpu_count=0, env={"CUDA_VISIBLE_DEVICES": ""}), 1, "GPU", "fail",
     "unset CUDA_VISIBLE_DEVICES"),
    ("driver older than torch's CUDA (major)", dict(cuda_driver_version="11.8", driver_version="520.61.05"), 1,
     "CUDA driver", "fail", "upgrade the NVIDIA driver to 570.26 or newer"),
    ("driver older than torch's CUDA (minor)", dict(cuda_driver_version="12.4", driver_version="550.54.15"), 1,
     "CUDA driver", "warn", "whl/cu124"),
    ("NCCL mismatch (installed wheel)", dict(packages={**HEALTHY.packages, "nvidia-nccl-cu12": "2.21.5"}), 2,
     "NCCL", "fail", "pip install nvidia-nccl-cu12==2.28.9"),
    ("NCCL mismatch (LD_LIBRARY_PATH)", dict(nccl_libs=[("/opt/nccl/lib/libnccl.so.2", "2.18.3")]), 2, "NCCL",
     "fail", "remove /opt/nccl/lib from LD_LIBRARY_PATH"),
    ("NCCL mismatch at TP 1", dict(packages={**HEALTHY.packages, "nvidia-nccl-cu12": "2.21.5"}), 1, "NCCL", "warn",
     "pip install nvidia-nccl-cu12==2.28.9"),
    ("P2P disabled", dict(env={"NCCL_P2P_DISABLE": "1"}), 2, "NCCL environment", "warn", "unset NCCL_P2P_DISABLE"),
    ("NCCL on a missing interface", dict(env={"NCCL_SOCKET_IFNAME": "ib0"}), 2, "NCCL environment", "fail",
     "set NCCL_SOCKET_IFNAME to one of those interfaces"),
    ("/dev/shm 64 MB", dict(shm_bytes=64 * MiB), 2, "/dev/shm", "fail", "docker run --shm-size=8g"),
    ("/dev/shm 64 MB at TP 1", dict(shm_bytes=64 * MiB), 1, "/dev/shm", "warn", "--ipc=host"),
    ("Triton cannot compile", dict(triton=(False, "RuntimeError: Failed to find C compiler. Please specify via CC "
                                                  "environment variable.")), 1, "Triton", "fail",
     "apt-get install gcc"),
    ("Triton's PTX too new", dict(triton=(False, "ptxas fatal: Unsupported .version 8.7")), 1, "Triton", "fail",
     "upgrade the NVIDIA driver"),
    ("AMD without ROCm torch", dict(gpus=[GpuInfo(0, "amd", "AMD Instinct MI250X / MI250", 64 * GiB)],
                                    cuda_driver_version=None, torch_cuda="12.8", nccl_version=None), 1, "torch",
     "fail", "https://download.pytorch.org/whl/rocm"),
    ("CPU torch on an NVIDIA GPU", dict(torch_version="2.9.0+cpu", torch_cuda=None, torch_gpu_count=0,
                                        nccl_version=None), 1, "torch", "fail", "whl/cu128"),
    ("torch pins another triton", dict(packages={**HEALTHY.packages, "triton": "3.4.0"}), 1, "versions", "fail",
     "pip install triton==3.5.0"),
    ("numpy 2.4 under triton 3.6", dict(packages={**HEALTHY.packages, "triton": "3.6.0", "numpy": "2.4.0"},
                                        torch_requires=[]), 1, "versions", "fail", "pip install 'numpy<2.4'"),
    ("transformers below the floor", dict(packages={**HEALTHY.packages, "transformers": "5.17.0"}), 1, "versions",
     "fail", "pip install -U 'transformers>=5.18'"),
    ("TP larger than the GPUs", dict(gpus=[H100], torch_gpu_count=1, p2p={}), 2, "GPU topology", "fail",
     "use a machine with 2 GPUs"),
    ("no P2P between the GPUs", dict(p2p={(0, 1): False}, nvlink=False), 2, "GPU topology", "warn",
     "nvidia-smi topo -m"),
    ("another process holds the GPU", dict(gpus=[replace(H100, used_bytes=40 * GiB, processes=(
        GpuProcess(4242, "python3", 40 * GiB),))]), 1, "GPU memory", "fail", "lower --gpu-memory-utilization to 0.48"),
]


@pytest.mark.parametrize(("what", "change", "tp", "name", "status", "fix"), FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_matrix(what, change, tp, name, status, fix):
    report = run_doctor(replace(HEALTHY, **change), tensor_parallel_size=tp)
    check = report.check(name)
    assert check.status == status, vars(check)
    assert fix in check.fix, vars(check)
    others = {n: s for n, s in statuses(report).items() if n != name and s == "fail"}
    assert not others or what in ("no GPU", "GPUs hidden", "AMD without ROCm torch", "CPU torch on an NVIDIA GPU",
                                  "TP larger than the GPUs"), others
    assert report.exit_code == (1 if status == "fail" or others else 0)


def test_70b_fp16_on_one_a10g_predicts_oom_with_tp_and_4_bit_remedies():
    env = replace(HEALTHY, gpus=[A10G], torch_gpu_count=1, p2p={}, nvlink=False)
    report = run_doctor(env, model="llama-2-70b")
    plan = report.check("memory plan")
    assert (plan.status, report.profile, report.plan.verdict) == ("fail", "a10g", "oom")
    assert report.plan.weights_bytes / GiB == pytest.approx(128.5, abs=0.1)  # 69B parameters in fp16
    assert report.plan.budget_bytes == int(0.9 * 23028 * MiB)
    by_action = {r.action: r for r in report.remedies}
    assert list(by_action) == ["raise --tensor-parallel-size to 8",
                               "quantize to 4-bit with AWQ and raise --tensor-parallel-size to 4"]
    tp8 = by_action["raise --tensor-parallel-size to 8"]
    assert tp8.plan.verdict == "fits" and tp8.plan.weights_bytes / GiB == pytest.approx(16.06, abs=0.01)
    assert tp8.plan.max_concurrency > 10 and tp8.supported
    awq = by_action["quantize to 4-bit with AWQ and raise --tensor-parallel-size to 4"]
    assert awq.plan.verdict == "fits" and awq.plan.weights_bytes / GiB == pytest.approx(8.53, abs=0.01)
    assert awq.flags == {"quantization": "awq", "tensor_parallel_size": 4}
    assert plan.fix.startswith("raise --tensor-parallel-size to 8: weights 16.06 GiB/GPU")
    assert report.recommendation == {"size_class": "72b", "tensor_parallel_size": 4, "quantization": "awq"}


def test_7b_fp16_on_an_rtx4090_is_tight_and_suggests_8_bit():
    env = replace(HEALTHY, gpus=[RTX4090], torch_gpu_count=1, p2p={}, nvlink=False)
    report = run_doctor(env, model="llama-2-7b", max_model_len=4096)
    plan = report.check("memory plan")
    assert (plan.status, report.profile, report.plan.verdict) == ("warn", "rtx4090", "tight")
    assert 2 < report.plan.max_concurrency < 4
    first = report.remedies[0]
    assert (first.action, first.flags, first.plan.verdict) == ("quantize to 8-bit (FP8)", {"quantization": "fp8"},
                                                               "fits")
    assert first.plan.max_concurrency > 1.5 * report.plan.max_concurrency
    assert "quantize to 8-bit (FP8): weights 6.53 GiB/GPU" in plan.fix
    assert report.healthy  # tight is a warning


def test_planning_for_a_named_profile_on_a_machine_without_gpu():
    env = replace(HEALTHY, gpus=[], torch_cuda=None, torch_gpu_count=0, nccl_version=None, triton=None)
    report = run_doctor(env, model="llama-3.1-8b", profile="l40s", max_model_len=8192)
    assert report.check("GPU").status == "warn" and report.profile == "l40s"
    assert report.plan.gpu_memory_bytes == 45 * GiB and report.plan.verdict == "fits"
    assert report.healthy


def test_an_fp8_kv_cache_is_offered_on_fp8_gpus_and_planned_when_asked_for():
    """llama-2-7b at 4096 tokens on one RTX 4090 (Ada: fp8) is tight: half the KV bytes per token doubles the
    concurrency; already asked for (--kv-cache-dtype fp8), it is planned and not offered again; on an A10G
    (Ampere: no fp8) it is never offered."""
    env = replace(HEALTHY, gpus=[RTX4090], torch_gpu_count=1, p2p={}, nvlink=False)
    report = run_doctor(env, model="llama-2-7b", max_model_len=4096)
    assert report.plan.verdict == "tight"
    kv = next(r for r in report.remedies if r.flags == {"kv_cache_dtype": "fp8"})
    assert kv.action == "store the KV cache in fp8 (--kv-cache-dtype fp8)"
    assert kv.plan.kv_bytes_per_token * 2 == report.plan.kv_bytes_per_token
    assert kv.plan.max_concurrency > 1.9 * report.plan.max_concurrency
    assert kv.plan.verdict == "fits" and kv.supported
    asked = run_doctor(env, model="llama-2-7b", max_model_len=4096, kv_cache_dtype="fp8")
    assert asked.plan.kv_bytes_per_token == kv.plan.kv_bytes_per_token
    assert not any(r.flags.get("kv_cache_dtype") for r in asked.remedies)
    a10g = replace(HEALTHY, gpus=[A10G], torch_gpu_count=1, p2p={}, nvlink=False)
    ampere = run_doctor(a10g, model="llama-2-7b").remedies
    assert ampere and not any(r.flags.get("kv_cache_dtype") for r in ampere)


def test_kv_cache_fp8_is_refused_on_gpus_without_fp8(monkeypatch):
    import torch

    from vserve.core.model_runner import kv_cache_torch_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 needs a GPU of compute capability >= 8.9 .*"
                                         r"NVIDIA A100-SXM4-80GB has 8.0: use --kv-cache-dtype auto"):
        kv_cache_torch_dtype("fp8", torch.bfloat16, torch.device("cuda", 0))
    assert kv_cache_torch_dtype("auto", torch.bfloat16, torch.device("cuda", 0)) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.float32, torch.device("cpu")) == torch.float8_e4m3fn


def test_lower_max_model_len_is_offered_when_one_sequence_does_not_fit():
    env = replace(HEALTHY, gpus=[A10G], torch_gpu_count=1, p2p={}, nvlink=False)
    report = run_doctor(env, model="llama-3.1-8b")  # 131072-token context
    assert report.plan.verdict == "oom"
    lower = next(r for r in report.remedies if r.action.startswith("lower --max-model-len"))
    assert lower.plan.verdict == "fits" and lower.plan.max_model_len % 256 == 0
    assert lower.plan.max_concurrency >= 4


def test_doctor_plans_a_config_json_and_a_model_folder(tmp_path):
    from vserve.ops.model_shapes import KNOWN_SHAPES

    (tmp_path / "config.json").write_text(json.dumps(KNOWN_SHAPES["qwen2.5-14b"]))
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        report = run_doctor(HEALTHY, model=model, max_model_len=4096)
        assert report.plan.verdict == "fits" and report.recommendation["size_class"] == "14b"


def test_cli_doctor_json_exits_1_on_failure(monkeypatch):
    env = replace(HEALTHY, gpus=[A10G], torch_gpu_count=1, p2p={}, nvlink=False)
    monkeypatch.setattr(probe, "probe_environment", lambda: env)
    res = runner.invoke(app, ["doctor", "llama-2-70b", "--json"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["healthy"] is False and out["plan"]["verdict"] == "oom"
    assert [r["flags"] for r in out["remedies"]] == [{"tensor_parallel_size": 8},
                                                     {"quantization": "awq", "tensor_parallel_size": 4}]
    assert {c["name"]: c["status"] for c in out["checks"]}["memory plan"] == "fail"


def test_cli_doctor_report_exits_0_when_healthy(monkeypatch):
    monkeypatch.setattr(probe, "probe_environment", lambda: HEALTHY)
    res = runner.invoke(app, ["doctor", "llama-3.1-8b", "--max-model-len", "8192", "--tensor-parallel-size", "2"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "healthy: no check failed" in res.stdout and "Memory plan: llama-3.1-8b on h100-sxm" in res.stdout


def test_cli_doctor_bad_input_is_one_error_line(monkeypatch):
    monkeypatch.setattr(probe, "probe_environment", lambda: HEALTHY)
    res = runner.invoke(app, ["doctor", "no-such-model"])
    assert res.exit_code == 2
    assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("error: model 'no-such-model' is not a folder")
    res = runner.invoke(app, ["doctor", "llama-3.1-8b", "--tensor-parallel-size", "3"])
    assert res.stderr.splitlines() == ["error: --tensor-parallel-size must divide the model's 32 attention heads, "
                                       "got 3"]


def test_the_real_probe_runs_here():
    env = probe.probe_environment(run_triton=False)
    assert env.torch_version is not None and "torch" in env.packages
    assert env.shm_bytes is None or env.shm_bytes > 0


def test_preflight_before_a_tp_launch_fails_on_small_shm_only_with_tp():
    from vserve.ops.doctor import preflight

    small = replace(HEALTHY, shm_bytes=64 * MiB)
    assert [c.name for c in preflight(small, 2)] == ["/dev/shm"]
    assert preflight(small, 1) == [] and preflight(HEALTHY, 2) == []
