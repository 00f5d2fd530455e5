"""Probe the real machine for `vserve doctor`: NVML, ROCm, torch, installed packages, NCCL, /dev/shm, Triton.

Each probe catches its own failure and leaves its field empty; ops/doctor.py turns the result into findings.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from vserve.ops.doctor import Environment
from vserve.profiles.detect import nvml_report, rocm_gpus

PACKAGES = ("torch", "triton", "pytorch-triton-rocm", "transformers", "numpy", "nvidia-ml-py",
            "nvidia-nccl-cu11", "nvidia-nccl-cu12", "nvidia-nccl-cu13")
ENV_PREFIXES = ("NCCL_", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
TRITON_PROGRAM = '''
import torch, triton, triton.language as tl

@triton.jit
def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

x = torch.arange(1000, device="cuda", dtype=torch.float32)
y = torch.empty_like(x)
add_one[(4,)](x, y, 1000, BLOCK=256)
assert torch.equal(y, x + 1), "wrong result"
'''


def _packages() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _nccl_libs() -> list[tuple[str, str | None]]:
    libs = []
    for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        for lib in sorted(Path(folder).glob("libnccl.so*")):
            m = re.search(r"libnccl\.so\.(\d+\.\d+\.\d+)", os.path.realpath(lib))
            libs.append((str(lib), m.group(1) if m else None))
            break
    return libs


def _shm_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_frsize * st.f_blocks


def _triton(timeout: float = 180) -> tuple[bool, str]:
    """Compile and run a tiny kernel in a child process (a crash or hang cannot take doctor down)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "triton_check.py"  # @triton.jit reads the kernel's source from a file
        script.write_text(TRITON_PROGRAM)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        try:
            res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                                 env=env)
        except subprocess.TimeoutExpired:
            return False, f"no result within {timeout:.0f} s"
    if res.returncode == 0:
        return True, "ok"
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    return False, lines[-1] if lines else f"exit status {res.returncode}"


def _torch(env: Environment) -> None:
    try:
        import torch
    except ImportError:
        return
    env.torch_version = torch.__version__
    env.torch_cuda = torch.version.cuda
    env.torch_hip = getattr(torch.version, "hip", None)
    try:
        env.torch_requires = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        env.torch_gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        env.torch_gpu_count = 0
    if env.torch_cuda:
        try:
            env.nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError, TypeError):
            pass


def probe_environment(run_triton: bool = True) -> Environment:
    """This machine, as doctor sees it (imports torch)."""
    nv = nvml_report()
    env = Environment(gpus=nv.gpus or rocm_gpus(), nvml_error=nv.error, driver_version=nv.driver_version,
                      cuda_driver_version=nv.cuda_driver_version, p2p=nv.p2p, nvlink=nv.nvlink)
    _torch(env)
    env.packages = _packages()
    env.nccl_libs = _nccl_libs()
    env.env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    try:
        env.net_interfaces = sorted(os.listdir("/sys/class/net"))
    except OSError:
        pass
    env.shm_bytes = _shm_bytes()
    if run_triton and env.torch_gpu_count:
        env.triton = _triton()
    return env
