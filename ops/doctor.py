"""`vserve doctor`'s checks. Each is a pure function of an `Environment` (ops/probe.py fills one on a real machine;
the CI fault matrix builds them by hand) returning status, finding and fix; the memory plan of a model on the
chosen GPU comes with ordered remedies, each with the numbers it would give."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vserve.core.memory import (
    TIGHT_CONCURRENCY,
    GiB,
    MemoryPlan,
    check_tensor_parallel,
    fmt_bytes,
    plan_memory,
)
from vserve.core.model_config import ModelConfig
from vserve.profiles import GpuProfile
from vserve.profiles.detect import GpuInfo, match_profile, resolve_profile

SHM_MIN_BYTES = GiB  # NCCL's shared-memory transport and TP workers want more than docker's 64 MB
# Minimum Linux driver for each CUDA release (CUDA toolkit release notes, table 3).
MIN_DRIVER = {"11.8": "520.61.05", "12.0": "525.60.13", "12.1": "530.30.02", "12.2": "535.54.03",
              "12.3": "545.23.06", "12.4": "550.54.14", "12.5": "555.42.02", "12.6": "560.28.03",
              "12.8": "570.26", "12.9": "575.51.03", "13.0": "580.65.06"}
RISKY_NCCL_VARS = {
    "NCCL_P2P_DISABLE": "forces tensor-parallel traffic through host memory (several times slower all-reduces)",
    "NCCL_SHM_DISABLE": "turns off the shared-memory transport, leaving sockets when P2P is unavailable",
    "NCCL_ALGO": "overrides NCCL's algorithm tuning",
    "NCCL_PROTO": "overrides NCCL's protocol tuning (LL128 off can halve bandwidth)",
    "NCCL_BLOCKING_WAIT": "is deprecated and ignored by torch; use TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_ASYNC_ERROR_HANDLING": "is deprecated and ignored by torch; use TORCH_NCCL_ASYNC_ERROR_HANDLING",
}


@dataclass
class Environment:
    """What doctor knows about the machine. Every field is plain data, so a test can describe any machine."""

    gpus: list[GpuInfo] = field(default_factory=list)
    nvml_error: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # the newest CUDA the driver supports, e.g. "12.4"
    p2p: dict[tuple[int, int], bool] = field(default_factory=dict)
    nvlink: bool = False
    torch_version: str | None = None  # None: torch is not importable
    torch_cuda: str | None = None  # torch.version.cuda
    torch_hip: str | None = None  # torch.version.hip
    torch_gpu_count: int = 0
    torch_requires: list[str] = field(default_factory=list)  # the torch wheel's Requires-Dist (its pins)
    packages: dict[str, str] = field(default_factory=dict)  # distribution -> installed version
    nccl_version: str | None = None  # torch.cuda.nccl.version()
    nccl_libs: list[tuple[str, str | None]] = field(default_factory=list)  # libnccl on LD_LIBRARY_PATH
    env: dict[str, str] = field(default_factory=dict)  # NCCL_*, *_VISIBLE_DEVICES
    net_interfaces: list[str] = field(default_factory=list)
    shm_bytes: int | None = None
    triton: tuple[bool, str] | None = None  # (a tiny kernel compiled and ran, message); None: not tried


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    finding: str
    fix: str = ""


@dataclass
class Remedy:
    action: str
    flags: dict[str, object]
    plan: MemoryPlan
    supported: bool  # vserve serves it today (all but quantized MoE experts)


@dataclass
class Report:
    checks: list[Check]
    model: str | None = None
    profile: str | None = None
    plan: MemoryPlan | None = None
    remedies: list[Remedy] = field(default_factory=list)
    recommendation: dict[str, object] = field(default_factory=dict)  # the profile's TP and quantization

    @property
    def healthy(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def as_dict(self) -> dict:
        return {"healthy": self.healthy, "model": self.model, "profile": self.profile,
                "checks": [vars(c) for c in self.checks],
                "plan": self.plan.as_dict() if self.plan else None,
                "recommendation": self.recommendation,
                "remedies": [{"action": r.action, "flags": r.flags, "supported": r.supported, "verdict": r.plan.verdict,
                              "weights_bytes": r.plan.weights_bytes, "num_blocks": r.plan.num_blocks,
                              "max_concurrency": r.plan.max_concurrency, "max_model_len": r.plan.max_model_len}
                             for r in self.remedies]}


def _ver(s: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", (s or "").split("+")[0])[:3])


def _pin(env: Environment, dist: str) -> str | None:
    """The version the torch wheel pins a distribution at (`triton==3.2.0; ...`)."""
    for req in env.torch_requires:
        m = re.match(rf"{re.escape(dist)}\s*==\s*([\w.]+)", req)
        if m:
            return m.group(1)
    return None


# ---- checks ------------------------------------------------------------------------------------------------


def check_gpu(env: Environment, planning_for: str | None) -> Check:
    if env.gpus:
        g = env.gpus[0]
        names = ", ".join(sorted({x.name for x in env.gpus}))
        driver = f", driver {env.driver_version}" if env.driver_version else ""
        return Check("GPU", "ok", f"{len(env.gpus)} x {names} ({g.memory_bytes / GiB:.1f} GiB){driver}")
    hidden = {k: v for k, v in env.env.items() if k.endswith("VISIBLE_DEVICES") and v.strip() in ("", "-1")}
    if hidden:
        k = next(iter(hidden))
        return Check("GPU", "fail", f"{k}={hidden[k]!r} hides every GPU", f"unset {k} (or list the GPUs to use)")
    why = f" ({env.nvml_error})" if env.nvml_error else ""
    if planning_for:
        return Check("GPU", "warn", f"no GPU on this machine{why}; planning for {planning_for}")
    return Check("GPU", "fail", f"no GPU found: NVML sees none{why} and no ROCm device is present",
                 "install the NVIDIA driver (nvidia-smi must list the GPU; in a container: docker run --gpus all), "
                 "or ROCm for AMD GPUs; without a GPU vserve runs on the CPU, slowly")


def check_torch(env: Environment) -> Check:
    if env.torch_version is None:
        return Check("torch", "fail", "torch is not importable", "pip install torch")
    vendors = {g.vendor for g in env.gpus}
    build = f"CUDA {env.torch_cuda}" if env.torch_cuda else f"ROCm/HIP {env.torch_hip}" if env.torch_hip else "CPU"
    finding = f"torch {env.torch_version} ({build} build)"
    if "amd" in vendors and not env.torch_hip:
        return Check("torch", "fail", f"an AMD GPU is present but {finding} is not a ROCm build",
                     "install torch's ROCm build matching your ROCm: pip install torch --index-url "
                     "https://download.pytorch.org/whl/rocm6.3 (Triton then comes as pytorch-triton-rocm)")
    if "nvidia" in vendors and not env.torch_cuda:
        cu = "".join(map(str, _ver(env.cuda_driver_version)[:2])) or "126"
        return Check("torch", "fail", f"an NVIDIA GPU is present but {finding} cannot use it",
                     f"pip install torch --index-url https://download.pytorch.org/whl/cu{cu} "
                     "(a CUDA build no newer than the driver supports)")
    if env.gpus and env.torch_gpu_count == 0:
        return Check("torch", "fail", f"{finding} sees no GPU although {len(env.gpus)} are present",
                     "check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES and that the driver loads (nvidia-smi)")
    return Check("torch", "ok", finding + (f", sees {env.torch_gpu_count} GPU(s)" if env.gpus else ""))


def check_cuda_driver(env: Environment) -> Check:
    if not env.torch_cuda or not any(g.vendor == "nvidia" for g in env.gpus) or not env.cuda_driver_version:
        return Check("CUDA driver", "skip", "no NVIDIA GPU with a CUDA build of torch")
    have, need = _ver(env.cuda_driver_version), _ver(env.torch_cuda)
    finding = (f"driver {env.driver_version} supports CUDA up to {env.cuda_driver_version}; torch was built for "
               f"CUDA {env.torch_cuda}")
    if have >= need[:2]:
        return Check("CUDA driver", "ok", finding)
    minimum = MIN_DRIVER.get(".".join(map(str, need[:2])))
    fix = (f"upgrade the NVIDIA driver to {minimum} or newer" if minimum else "upgrade the NVIDIA driver") + (
        f", or install torch built for CUDA {env.cuda_driver_version} or older "
        f"(pip install torch --index-url https://download.pytorch.org/whl/cu{''.join(map(str, have[:2]))})")
    if have[:1] < need[:1]:
        return Check("CUDA driver", "fail", finding + ": torch cannot initialize CUDA", fix)
    return Check("CUDA driver", "warn", finding + ": torch runs by minor-version compatibility, but Triton's PTX "
                 "needs a driver that knows its CUDA version", fix)


def check_versions(env: Environment) -> Check:
    pk = env.packages
    found = []
    triton_dist = "pytorch-triton-rocm" if env.torch_hip else "triton"
    pin = _pin(env, triton_dist)
    if pin and pk.get(triton_dist) and _ver(pk[triton_dist]) != _ver(pin):
        found.append((f"torch {env.torch_version} pins {triton_dist} {pin} but {pk[triton_dist]} is installed",
                      f"pip install {triton_dist}=={pin}"))
    if _ver(pk.get("triton")) >= (3, 6) and _ver(pk.get("numpy")) >= (2, 4):
        found.append((f"triton {pk['triton']}'s interpreter (the CPU path) breaks on numpy {pk['numpy']}",
                      "pip install 'numpy<2.4'"))
    if pk.get("transformers") and _ver(pk["transformers"]) < (5, 18):  # pyproject.toml's floor
        found.append((f"transformers {pk['transformers']} is older than vserve needs (5.18: older ones import torch "
                      f"with the tokenizer, which slows every start)", "pip install -U 'transformers>=5.18'"))
    if env.torch_version and _ver(env.torch_version) < (2, 6):
        found.append((f"torch {env.torch_version} is older than vserve needs (2.6)", "pip install -U 'torch>=2.6'"))
    listed = ", ".join(f"{n} {pk[n]}" for n in ("torch", "triton", "pytorch-triton-rocm", "transformers") if n in pk)
    if not found:
        return Check("versions", "ok", listed or "no packages reported")
    return Check("versions", "fail", "; ".join(f for f, _ in found), "; ".join(x for _, x in found))


def check_nccl(env: Environment, tp: int) -> Check:
    if env.nccl_version is None:
        return Check("NCCL", "skip", "torch reports no NCCL (a CPU or ROCm build; ROCm uses RCCL)")
    pin_dist = next((d for d in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11") if _pin(env, d)), None)
    expected = _pin(env, pin_dist) if pin_dist else env.nccl_version
    found, fixes = [], []
    if _ver(env.nccl_version) != _ver(expected):
        found.append(f"torch loads NCCL {env.nccl_version} but was built against {pin_dist} {expected}")
    for dist in sorted(d for d in env.packages if d.startswith("nvidia-nccl-")):
        if _ver(env.packages[dist]) != _ver(expected):
            found.append(f"{dist} {env.packages[dist]} is installed")
            fixes.append(f"pip install {dist}=={expected}")
    for path, version in env.nccl_libs:
        if version is not None and _ver(version) != _ver(expected):
            found.append(f"{path} (NCCL {version}) on LD_LIBRARY_PATH shadows it")
            fixes.append(f"remove {path.rsplit('/', 1)[0]} from LD_LIBRARY_PATH")
    if not found:
        return Check("NCCL", "ok", f"NCCL {env.nccl_version}, as torch expects")
    status = "fail" if tp > 1 else "warn"  # NCCL only runs with tensor parallelism
    return Check("NCCL", status, f"torch expects NCCL {expected}: " + "; ".join(found),
                 "; ".join(dict.fromkeys(fixes)) or f"pip install {pin_dist or 'nvidia-nccl-cu12'}=={expected}")


def check_nccl_env(env: Environment, tp: int) -> Check:
    found = [f"{k}={env.env[k]} {why}" for k, why in RISKY_NCCL_VARS.items() if env.env.get(k, "0") not in ("", "0")]
    fixes = [f"unset {k}" for k in RISKY_NCCL_VARS if env.env.get(k, "0") not in ("", "0")]
    ifname = env.env.get("NCCL_SOCKET_IFNAME")
    if ifname and env.net_interfaces:
        wanted = [n.lstrip("^=") for n in ifname.split(",")]
        if not ifname.startswith("^") and not any(i.startswith(w) for w in wanted for i in env.net_interfaces):
            found.append(f"NCCL_SOCKET_IFNAME={ifname} names no interface here ({', '.join(env.net_interfaces)})")
            fixes.append("set NCCL_SOCKET_IFNAME to one of those interfaces, or unset it")
    if not found:
        return Check("NCCL environment", "ok", "no NCCL_* variable known to break or slow runs")
    return Check("NCCL environment", "fail" if tp > 1 and ifname and fixes[-1].startswith("set") else "warn",
                 "; ".join(found), "; ".join(fixes))


def check_topology(env: Environment, tp: int) -> Check:
    if tp <= 1:
        return Check("GPU topology", "skip", "tensor-parallel size 1")
    if len(env.gpus) < tp:
        return Check("GPU topology", "fail", f"--tensor-parallel-size {tp} needs {tp} GPUs, this machine has "
                     f"{len(env.gpus)}", f"use a machine with {tp} GPUs, or quantize to need fewer (see the plan)")
    missing = [(i, j) for (i, j), ok in env.p2p.items() if i < tp and j < tp and not ok]
    if missing:
        pairs = ", ".join(f"{i}-{j}" for i, j in missing)
        return Check("GPU topology", "warn", f"no peer-to-peer path between GPUs {pairs}: NCCL goes through host "
                     "memory (normal for GeForce cards, whose P2P the driver disables)",
                     "pick GPUs behind one PCIe switch or NVLink (nvidia-smi topo -m) with CUDA_VISIBLE_DEVICES")
    return Check("GPU topology", "ok", f"{'NVLink' if env.nvlink else 'PCIe peer-to-peer'} between the first {tp} GPUs")


def check_triton(env: Environment) -> Check:
    if env.triton is None:
        return Check("Triton", "skip", "no GPU to compile for (the CPU path runs the torch references)")
    ok, message = env.triton
    if ok:
        return Check("Triton", "ok", "a tiny kernel compiled and ran")
    low = message.lower()
    if "compiler" in low or "cc" in low.split():
        fix = "install a C compiler (apt-get install gcc): Triton builds a small launcher per kernel"
    elif "python.h" in low:
        fix = "install the Python headers (apt-get install python3-dev)"
    elif "ptx" in low or "unsupported toolchain" in low:
        fix = "upgrade the NVIDIA driver: it cannot load the PTX this Triton emits"
    elif "permission" in low or "read-only" in low:
        fix = "make ~/.triton/cache writable, or point TRITON_CACHE_DIR at a writable folder"
    else:
        fix = "install the triton version torch pins (pip show torch) and run again with TRITON_DEBUG=1"
    return Check("Triton", "fail", f"compiling a tiny kernel failed: {message}", fix)


def check_shm(env: Environment, tp: int) -> Check:
    if env.shm_bytes is None:
        return Check("/dev/shm", "skip", "no /dev/shm on this system")
    size = fmt_bytes(env.shm_bytes)
    if env.shm_bytes >= SHM_MIN_BYTES:
        return Check("/dev/shm", "ok", f"{size}")
    return Check("/dev/shm", "fail" if tp > 1 else "warn",
                 f"/dev/shm is {size} (docker's default is 64 MB): NCCL and tensor-parallel workers run out of it",
                 "docker run --shm-size=8g (or --ipc=host); on Kubernetes mount an emptyDir with medium: Memory "
                 "at /dev/shm")


def check_gpu_memory(env: Environment, utilization: float) -> Check:
    if not env.gpus:
        return Check("GPU memory", "skip", "no GPU")
    worst = None
    for g in env.gpus:
        used = g.used_bytes or 0
        free = g.memory_bytes - used
        if free < utilization * g.memory_bytes and (worst is None or free < worst[1]):
            worst = (g, free, used)
    if worst is None:
        return Check("GPU memory", "ok", f"free enough for --gpu-memory-utilization {utilization}")
    g, free, used = worst
    holders = ", ".join(f"pid {p.pid} ({p.name}, {fmt_bytes(p.used_bytes)})" for p in g.processes) or "other processes"
    fits = max(0.0, free / g.memory_bytes - 0.02)
    return Check("GPU memory", "fail", f"GPU {g.index}: {fmt_bytes(used)} of {fmt_bytes(g.memory_bytes)} is held by "
                 f"{holders}; --gpu-memory-utilization {utilization} needs {fmt_bytes(utilization * g.memory_bytes)}",
                 f"stop those processes, or lower --gpu-memory-utilization to {fits:.2f}")


# ---- the memory plan and its remedies ---------------------------------------------------------------------

_RANK = {"oom": 0, "tight": 1, "fits": 2}


def _describe(p: MemoryPlan) -> str:
    return (f"weights {fmt_bytes(p.weights_bytes)}/GPU, KV cache {fmt_bytes(p.kv_cache_bytes)} "
            f"({p.num_blocks} blocks, {p.kv_bytes_per_token / 1024:g} KiB/token), "
            f"{p.max_concurrency:.1f} x --max-model-len {p.max_model_len} at once")


def _valid_tp(m: ModelConfig, tp: int) -> bool:
    try:
        check_tensor_parallel(m, tp)
    except ValueError:
        return False
    return True


BITS = {None: 16, "fp8": 8, "int8": 8, "awq": 4, "gptq": 4}


def remedies(m: ModelConfig, plan: MemoryPlan, settings: dict, profile: GpuProfile | None) -> list[Remedy]:
    """What would make the plan fit (or fit better), in order: quantize, raise TP, quantize and raise TP, an fp8
    KV cache (GPUs with fp8), lower --max-model-len or --max-num-seqs, raise --gpu-memory-utilization; each with
    the plan it would give."""
    if plan.verdict == "fits":
        return []
    out: list[Remedy] = []

    def better(p: MemoryPlan) -> bool:
        return _RANK[p.verdict] > _RANK[plan.verdict]

    def plan_with(**changes) -> MemoryPlan:
        return plan_memory(m, **{**settings, **changes})

    def add(action: str, changes: dict, p: MemoryPlan) -> None:
        q = changes.get("quantization", settings.get("quantization"))
        out.append(Remedy(action, changes, p, supported=q is None or not m.num_experts))

    bits = BITS.get(settings.get("quantization"), 16)
    eight = "fp8" if profile is None or profile.fp8 else "int8"
    quant_fits = False
    for q, label in ((eight, f"quantize to 8-bit ({eight.upper()})"), ("awq", "quantize to 4-bit with AWQ")):
        if BITS[q] < bits:
            p = plan_with(quantization=q)
            if better(p):
                add(label, {"quantization": q}, p)
            if p.verdict == "fits":
                quant_fits = True
                break
    tp = settings.get("tensor_parallel_size", 1)
    bigger = [t for t in (2, 4, 8) if t > tp and _valid_tp(m, t)]
    tp_plans = [(t, plan_with(tensor_parallel_size=t)) for t in bigger]
    pick = (next((x for x in tp_plans if x[1].verdict == "fits"), None)
            or next((x for x in tp_plans if better(x[1])), None))
    if pick:
        add(f"raise --tensor-parallel-size to {pick[0]}", {"tensor_parallel_size": pick[0]}, pick[1])
    if not quant_fits and bits > 4:
        for t in bigger:
            p = plan_with(quantization="awq", tensor_parallel_size=t)
            if p.verdict == "fits" and (pick is None or pick[1].verdict != "fits" or t < pick[0]):
                add(f"quantize to 4-bit with AWQ and raise --tensor-parallel-size to {t}",
                    {"quantization": "awq", "tensor_parallel_size": t}, p)
                break
    if (profile is None or profile.fp8) and settings.get("kv_dtype_bytes") != 1 and \
            better(p := plan_with(kv_dtype_bytes=1)):
        add("store the KV cache in fp8 (--kv-cache-dtype fp8)", {"kv_cache_dtype": "fp8"}, p)
    if plan.num_blocks > 0:
        length = plan.num_blocks * plan.block_size // min(TIGHT_CONCURRENCY, plan.max_num_seqs) // 256 * 256
        if length < 256:
            length = plan.num_blocks * plan.block_size
        if length < plan.max_model_len and better(p := plan_with(max_model_len=length)):
            add(f"lower --max-model-len to {length}", {"max_model_len": length}, p)
    if plan.max_num_seqs > 16 and better(p := plan_with(max_num_seqs=plan.max_num_seqs // 4)):
        add(f"lower --max-num-seqs to {plan.max_num_seqs // 4}", {"max_num_seqs": plan.max_num_seqs // 4}, p)
    if plan.gpu_memory_utilization < 0.95 and better(p := plan_with(gpu_memory_utilization=0.95)):
        add("raise --gpu-memory-utilization to 0.95", {"gpu_memory_utilization": 0.95}, p)
    return out


def is_hub_model(model: str | None) -> bool:
    from vserve.core.hub import HubModel, is_local
    from vserve.ops.model_shapes import KNOWN_SHAPES

    return bool(model) and model not in KNOWN_SHAPES and not is_local(model) and HubModel.parse(model) is not None


def hub_config(model: str, revision: str | None, download_dir: str | None) -> str:
    """A hub id's config.json (cached, or that one file fetched) as a local path, for planning."""
    from vserve.core.hub import config_file

    return str(config_file(model, revision=revision, download_dir=download_dir))


def check_download(model: str, revision: str | None, download_dir: str | None) -> Check:
    """A hub model: in the cache already, or how much `vserve serve` would download and whether the disk holds it."""
    from vserve.core import hub

    name = "download"
    try:
        if hub._offline():
            path = hub.resolve(model, revision=revision, download_dir=download_dir)
            return Check(name, "ok", f"in the Hugging Face cache: {path} (HF_HUB_OFFLINE=1)")
        plan = hub.download_plan(model, revision=revision, download_dir=download_dir)
    except ValueError as e:
        return Check(name, "fail", str(e))
    total = sum(plan.files.values())
    if plan.missing_bytes == 0:
        return Check(name, "ok", f"all {len(plan.files)} files ({fmt_bytes(total)}) in the cache {plan.cache}")
    finding = (f"{fmt_bytes(plan.missing_bytes)} of {len(plan.files)} files ({fmt_bytes(total)}) to download into "
               f"{plan.cache}, {fmt_bytes(plan.free_bytes)} free")
    if plan.missing_bytes > plan.free_bytes:
        return Check(name, "fail", finding, "free disk space or pass --download-dir on a larger disk")
    return Check(name, "ok", finding)


def load_model(model: str) -> ModelConfig:
    """A model folder, .gguf file, config.json or known shape name -> its ModelConfig (for planning)."""
    if model.endswith(".gguf"):
        from vserve.core.gguf_file import gguf_config  # imports torch; doctor's probing has already
        from vserve.ops.model_shapes import planning_config

        return planning_config(gguf_config(model))
    from vserve.ops.model_shapes import read_model_config

    return read_model_config(model)


def check_plan(env: Environment, model: str | None, profile: str | None, tp: int, max_model_len: int | None,
               overrides: dict, revision: str | None = None, download_dir: str | None = None) -> tuple[Check, Report]:
    report = Report([], model=model)
    if model is None:
        return Check("memory plan", "skip", "no MODEL given"), report
    if profile is None and not env.gpus:
        return Check("memory plan", "skip", "no GPU here and no --profile to plan for"), report
    gpu_memory = None
    if profile in (None, "auto"):
        if not env.gpus:
            return Check("memory plan", "fail", "--profile auto found no GPU", "pass --profile NAME"), report
        prof, warning = match_profile(env.gpus[0])
        gpu_memory = env.gpus[0].memory_bytes
    else:
        prof, warning = resolve_profile(profile)
        gpu_memory = prof.memory_bytes
    report.profile = prof.name
    source = hub_config(model, revision, download_dir) if is_hub_model(model) else model
    m = load_model(source)
    from vserve.profiles.settings import settings_for

    ps = settings_for(prof, source)
    if ps.size_class:
        rec = prof.models[ps.size_class]
        report.recommendation = {"size_class": ps.size_class, "tensor_parallel_size": rec.tensor_parallel_size,
                                 "quantization": rec.quantization}
    settings = {**prof.engine, "gpu_memory_bytes": gpu_memory, "tensor_parallel_size": tp,
                "max_model_len": max_model_len, "sliding_window": m.kv_window(),
                **{k: v for k, v in overrides.items() if v is not None}}
    plan = plan_memory(m, **settings)
    report.plan = plan
    report.remedies = remedies(m, plan, settings, prof)
    where = f"on {prof.display_name}" + (f" ({warning})" if warning else "")
    finding = f"{plan.verdict} {where}: {_describe(plan)}" + (f"; {plan.reason}" if plan.reason else "")
    fix = ""
    if report.remedies:
        r = report.remedies[0]
        fix = f"{r.action}: {_describe(r.plan)} ({r.plan.verdict})"
        if not r.supported:
            fix += "; vserve does not serve quantized MoE experts yet"
        elif r.flags.get("quantization"):
            fix += f" (quantize first: vserve quantize MODEL --method {r.flags['quantization']} --output-dir DIR)"
    return Check("memory plan", {"fits": "ok", "tight": "warn", "oom": "fail"}[plan.verdict], finding, fix), report


def run_doctor(env: Environment, model: str | None = None, profile: str | None = None, tensor_parallel_size: int = 1,
               max_model_len: int | None = None, quantization: str | None = None,
               gpu_memory_utilization: float | None = None, max_num_seqs: int | None = None,
               kv_cache_dtype: str = "auto", revision: str | None = None,
               download_dir: str | None = None, max_loras: int = 0, max_lora_rank: int = 16) -> Report:
    tp = tensor_parallel_size
    planning_for = profile if profile not in (None, "auto") else None
    plan_check, report = check_plan(env, model, profile, tp, max_model_len, {
        "quantization": quantization, "gpu_memory_utilization": gpu_memory_utilization, "max_num_seqs": max_num_seqs,
        "kv_dtype_bytes": 1 if kv_cache_dtype.startswith("fp8") else None, "max_loras": max_loras or None,
        "max_lora_rank": max_lora_rank}, revision, download_dir)
    utilization = gpu_memory_utilization or (report.plan.gpu_memory_utilization if report.plan else 0.9)
    report.checks = [check_gpu(env, planning_for), check_torch(env), check_cuda_driver(env), check_versions(env),
                     check_nccl(env, tp), check_nccl_env(env, tp), check_topology(env, tp), check_triton(env),
                     check_shm(env, tp), check_gpu_memory(env, utilization), plan_check]
    if is_hub_model(model):
        report.checks.append(check_download(model, revision, download_dir))
    return report


def preflight(env: Environment, tp: int) -> list[Check]:
    """The checks a multi-GPU launch runs first (NCCL, its environment, /dev/shm); those that fail."""
    checks = [check_nccl(env, tp), check_nccl_env(env, tp), check_shm(env, tp)]
    return [c for c in checks if c.status == "fail"]
