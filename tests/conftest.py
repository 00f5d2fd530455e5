"""Shared fixtures: the embedded default model folder and tiny random HF models built with transformers."""

import os

# Triton kernels run under the interpreter on CPU; this must be set before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VSERVE_NO_PROGRESS", "1")

import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import vserve  # noqa: E402, F401  (first: it takes the checkout's root off sys.path before transformers is imported)

sys.path.append(str(Path(__file__).parent))  # test helper modules (hf_cache, hub_server) import by name

if os.environ["TRITON_INTERPRET"] == "1":
    import triton_interp  # noqa: E402

    triton_interp.install()  # helper calls inside an interpreted launch skip the language's re-patching

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture
def seed() -> int:
    """A fresh seed each run (torch.manual_seed), for kernel tests to name in every failure message so a failing
    draw can be replayed."""
    import torch

    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    return s


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from vserve.ops.assets import default_model_path

    return default_model_path()


def _config(arch: str, **overrides):
    import transformers

    base = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    return cls(**base)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model_dir):
    """build(arch, **config overrides) -> folder with a random HF model (float32) and SmolLM2's tokenizer."""
    import torch
    import transformers

    cache: dict = {}

    def build(arch: str = "llama", **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items())))
        if key in cache:
            return cache[key]
        cfg = _config(arch, **overrides)
        torch.manual_seed(len(cache) + 1)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(folder, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (default_model_dir / name).exists():
                shutil.copy(default_model_dir / name, folder / name)
        cache[key] = folder
        return folder

    return build


# ---- a real `vserve serve` process on loopback ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def engine_pid(self) -> int | None:
        """The engine process's pid from the server's log (None: the engine loop runs on a thread)."""
        import re

        found = re.search(r"engine process started \(pid (\d+)\)", self.output())
        return int(found.group(1)) if found else None

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    """Whether a process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="session")
def process_alive():
    return pid_alive


def _start_server(args: list[str], log: Path, timeout: float = 120, env: dict | None = None) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "vserve.cli.main", "serve", *args, "--port", str(port)]
    fh = log.open("w")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                            env={**os.environ, "VSERVE_NO_PROGRESS": "1", **(env or {})})
    server = ServerProcess(proc, port, log)
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.output()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not come up in {timeout} s:\n{server.output()}")


@pytest.fixture(scope="module")
def server_factory():
    """start(args, log_path) -> a running ServerProcess; every server started is stopped at module end."""
    started = []

    def start(args, log, **kw):
        s = _start_server(args, log, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def _hf_greedy(folder, prompts, new_tokens: int, attn_implementation: str | None = None) -> list[list[int]]:
    """HF transformers greedy `generate`, one prompt at a time (no padding in the reference), eos disabled;
    attn_implementation "eager" where only that one has the model's attention (Gemma 2's softcap)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation=attn_implementation).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding in the reference
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def assert_same_tokens(got: list[list[int]], expected: list[list[int]], prompts, note: str = "") -> None:
    """Each prompt's tokens equal the reference's; else where they first differ."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        first_diff = next((j for j in range(len(e)) if j >= len(g) or g[j] != e[j]), None)
        assert g == e, f"prompt {i} (len {len(prompts[i])}) diverges at token {first_diff} {note}"


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(folder, prompts, new_tokens) -> the reference token ids for each prompt."""
    return _hf_greedy
