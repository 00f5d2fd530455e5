"""GPU auto-detection: NVIDIA through nvidia-ml-py (pynvml), AMD through rocm-smi or sysfs, torch as a last resort.

Every probe returns plain data, and `resolve_profile` takes the GPUs as an argument, so tests fake the machine.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from vserve.core.memory import GiB
from vserve.profiles import GpuProfile, all_profiles, get_profile

log = logging.getLogger("vserve.profiles")
AMD_DEVICE_NAMES = {"0x740c": "AMD Instinct MI250X / MI250", "0x740f": "AMD Instinct MI210",
                    "0x74a1": "AMD Instinct MI300X", "0x74a5": "AMD Instinct MI325X"}


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int


@dataclass(frozen=True)
class GpuInfo:
    index: int
    vendor: str  # nvidia | amd
    name: str
    memory_bytes: int
    used_bytes: int | None = None
    processes: tuple[GpuProcess, ...] = ()


@dataclass
class NvmlReport:
    """What NVML says about the machine (empty gpus and an error when NVML is unavailable)."""

    gpus: list[GpuInfo] = field(default_factory=list)
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # the newest CUDA the driver supports, e.g. "12.4"
    p2p: dict[tuple[int, int], bool] = field(default_factory=dict)  # (i, j) -> peer-to-peer reads work
    nvlink: bool = False  # any NVLink link active
    error: str | None = None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_report() -> NvmlReport:
    try:
        import pynvml
    except ImportError:
        return NvmlReport(error="nvidia-ml-py is not installed (pip install nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return NvmlReport(error=f"NVML: {e}")
    try:
        rep = NvmlReport(driver_version=_text(pynvml.nvmlSystemGetDriverVersion()))
        v = pynvml.nvmlSystemGetCudaDriverVersion()
        rep.cuda_driver_version = f"{v // 1000}.{v % 1000 // 10}"
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        for i, h in enumerate(handles):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            procs = []
            try:
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    try:
                        pname = _text(pynvml.nvmlSystemGetProcessName(p.pid))
                    except pynvml.NVMLError:
                        pname = "?"
                    procs.append(GpuProcess(p.pid, pname, int(p.usedGpuMemory or 0)))
            except pynvml.NVMLError:
                pass
            rep.gpus.append(GpuInfo(i, "nvidia", _text(pynvml.nvmlDeviceGetName(h)), int(mem.total),
                                    int(mem.used), tuple(procs)))
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    rep.nvlink |= pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:
                    break
        for i, a in enumerate(handles):
            for j, b in enumerate(handles):
                if i < j:
                    try:
                        ok = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_READ)
                        rep.p2p[(i, j)] = ok == pynvml.NVML_P2P_STATUS_OK
                    except pynvml.NVMLError:
                        rep.p2p[(i, j)] = False
        return rep
    except pynvml.NVMLError as e:
        return NvmlReport(error=f"NVML: {e}")
    finally:
        pynvml.nvmlShutdown()


def _rocm_smi_gpus() -> list[GpuInfo]:
    exe = shutil.which("rocm-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--showproductname", "--showmeminfo", "vram", "--json"], capture_output=True,
                             text=True, timeout=20).stdout
        cards = json.loads(out)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return []
    gpus = []
    for key, info in cards.items():
        if not key.startswith("card") or not isinstance(info, dict):
            continue
        low = {k.lower(): v for k, v in info.items()}
        name = low.get("card series") or low.get("card model") or "AMD GPU"
        total = int(low.get("vram total memory (b)") or 0)
        used = low.get("vram total used memory (b)")
        gpus.append(GpuInfo(int(key[4:] or 0), "amd", str(name), total, int(used) if used else None))
    return gpus


def _sysfs_amd_gpus(root: Path = Path("/sys/class/drm")) -> list[GpuInfo]:
    """AMD GPUs the amdgpu driver exposes, even without ROCm (so doctor can say ROCm is missing)."""
    gpus = []
    for card in sorted(root.glob("card[0-9]*")):
        dev = card / "device"
        try:
            if (dev / "vendor").read_text().strip() != "0x1002" or not (dev / "mem_info_vram_total").exists():
                continue
            total = int((dev / "mem_info_vram_total").read_text())
            device = (dev / "device").read_text().strip()
        except (OSError, ValueError):
            continue
        if total < 4 * GiB:  # an integrated GPU
            continue
        name = AMD_DEVICE_NAMES.get(device, f"AMD GPU (device {device})")
        gpus.append(GpuInfo(len(gpus), "amd", name, total))
    return gpus


def rocm_gpus() -> list[GpuInfo]:
    return _rocm_smi_gpus() or _sysfs_amd_gpus()


def torch_gpus() -> list[GpuInfo]:
    """What torch sees (CUDA or a ROCm/HIP build); imports torch, so only a last resort."""
    import torch

    if not torch.cuda.is_available():
        return []
    vendor = "amd" if torch.version.hip else "nvidia"
    return [GpuInfo(i, vendor, p.name, p.total_memory)
            for i, p in ((i, torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count()))]


@functools.cache
def detect_gpus() -> tuple[GpuInfo, ...]:
    """This machine's GPUs, probed once per process."""
    return tuple(nvml_report().gpus or rocm_gpus() or torch_gpus())


def match_profile(gpu: GpuInfo, profiles: tuple[GpuProfile, ...] | None = None) -> tuple[GpuProfile, str | None]:
    """The profile whose name pattern matches (nearest memory among several); else the nearest by memory, warned."""
    profiles = profiles or all_profiles()
    near = lambda p: (abs(p.memory_bytes - gpu.memory_bytes), p.name)  # noqa: E731
    named = [p for p in profiles if any(re.search(rx, gpu.name, re.I) for rx in p.match)]
    if named:
        return min(named, key=near), None
    same = [p for p in profiles if p.vendor == gpu.vendor] or list(profiles)
    best = min(same, key=near)
    return best, (f"unknown GPU {gpu.name!r} ({gpu.memory_bytes / GiB:.1f} GiB): using the profile nearest by "
                  f"memory, {best.name} ({best.memory_gb:g} GB); pass --profile NAME to choose one")


def resolve_profile(name: str, gpus: tuple[GpuInfo, ...] | list[GpuInfo] | None = None,
                    ) -> tuple[GpuProfile, str | None]:
    """A profile by name, or for "auto" the first GPU's (gpus default: detect_gpus()); (profile, warning)."""
    if name != "auto":
        return get_profile(name), None
    gpus = detect_gpus() if gpus is None else gpus
    if not gpus:
        raise ValueError("--profile auto found no GPU (neither NVML nor ROCm reports one); pass --profile NAME")
    return match_profile(gpus[0])
