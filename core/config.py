"""Engine configuration: defaults < profile < explicit flags, remembering where each value came from."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

BLOCK_SIZES = (16, 32, 64, 128, 256)
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# --quantization: the layout the checkpoint holds (fp8 and int8 read compressed-tensors' float/int-quantized)
QUANTIZATION_METHODS = ("awq", "gptq", "fp8", "int8", "compressed-tensors")
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # --max-lora-rank's choices (vLLM's)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model's dtype; fp8 / fp8_e4m3: float8 e4m3fn, scale 1
# structured outputs' grammar engine; auto: xgrammar, llguidance where xgrammar refuses a grammar (as vLLM's auto)
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass
class EngineConfig:
    """Every engine flag, named as vLLM names it (`--max-num-seqs` -> max_num_seqs)."""

    model: str | None = None  # None: the embedded default model; a local path, or a hub id (org/name[:QUANT])
    tokenizer: str | None = None
    revision: str | None = None  # hub branch, tag or commit of the model (None: main)
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # None: the Hugging Face cache (HF_HOME / HF_HUB_CACHE)
    hf_token: str | None = field(default=None, repr=False)  # None: HF_TOKEN or the token saved by `hf auth login`
    gguf_file: str | None = None  # the one GGUF file of a hub repo to serve
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: on for one CUDA GPU (overlap host work with the GPU step)
    engine_process: bool | None = None  # the core in a process of its own; None: for a server, and on a GPU
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # most prefill tokens of one request per step (seeds: chunk_size)
    cache_size_gb: float | None = None  # GiB per GPU the prefix cache's unused cached blocks may hold; None: all free
    quantization: str | None = None  # None: from config.json's quantization_config
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1  # the ranks (TP x PP) are spread evenly over this many nodes
    node_rank: int = 0  # node 0 runs the engine (and the server); the others run ranks only
    master_addr: str = "127.0.0.1"  # node 0's address for the torch.distributed rendezvous
    master_port: int | None = None  # None: a free port (one node only)
    # The seeds' multi-node spelling: "host:port,host:port,..." one per node, node 0's first; it sets nnodes and the
    # rendezvous (master_addr, master_port) from the first address
    worker_addresses: str | None = None
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids and outputs carry no text
    device: str = "auto"  # auto: cuda when available, else cpu
    kv_cache_memory_gib: float | None = None  # CPU KV cache size; None: 1 GiB or a quarter of free RAM
    num_kv_blocks: int | None = None  # force the number of KV blocks (tests, experiments)
    enable_lora: bool = False  # serve LoRA adapters (docs/lora.md)
    max_loras: int = 1  # adapters resident on the device at once (and so in one batch)
    max_cpu_loras: int | None = None  # adapters kept in host memory; None: max_loras
    max_lora_rank: int = 16
    structured_outputs_backend: str = "auto"
    profile: str | None = None  # a GPU profile (`vserve profiles list`) or auto: fills what flags leave unset
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.worker_addresses is not None:
            self._apply_worker_addresses()
        self.validate()

    def _apply_worker_addresses(self) -> None:
        """--worker-addresses ip1:8000,ip2:8001 -> --nnodes 2 --master-addr ip1 --master-port 8000."""
        nodes = []
        for part in self.worker_addresses.split(","):
            host, _, port = part.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--worker-addresses must be host:port,host:port,... (one per node, node 0's first), "
                                 f"got {self.worker_addresses!r}")
            nodes.append((host.strip("[]"), int(port)))
        implied = {"nnodes": len(nodes), "master_addr": nodes[0][0], "master_port": nodes[0][1]}
        defaults = {"nnodes": 1, "master_addr": "127.0.0.1", "master_port": None}
        for name, value in implied.items():
            given = getattr(self, name)
            if given != defaults[name] and given != value:
                raise ValueError(f"--worker-addresses sets --{name.replace('_', '-')} {value}, but "
                                 f"--{name.replace('_', '-')} {given} was given: give one")
            setattr(self, name, value)

    # The seeds' names for engine arguments vLLM names otherwise (LLM(chunk_size=512) is long_prefill_token_threshold).
    ALIASES = {"chunk_size": "long_prefill_token_threshold"}

    def validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            flag = "--" + name.replace("_", "-")
            return ValueError(f"{flag} must be {rule}, got {getattr(self, name)!r}")

        if self.block_size not in BLOCK_SIZES:
            raise bad("block_size", f"one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"one of {', '.join(LOAD_FORMATS)}")
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise bad("structured_outputs_backend", f"one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", ">= 1")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", ">= 1")
        if self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", ">= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", ">= 1")
        if self.pipeline_parallel_size < 1:
            raise bad("pipeline_parallel_size", ">= 1")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.nnodes < 1 or world % self.nnodes:
            raise bad("nnodes", f"a divisor of tensor x pipeline parallel size ({world})")
        if not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"in [0, {self.nnodes})")
        if self.async_scheduling and world > 1:
            raise bad("async_scheduling", "off with tensor or pipeline parallelism (not supported there yet)")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise bad("master_port", "in 1..65535")
        if self.nnodes > 1 and self.master_port is None:
            raise bad("master_port", "set when --nnodes > 1")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise bad("quantization", f"one of {', '.join(QUANTIZATION_METHODS)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", "auto, cpu or cuda")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", ">= 1")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise bad("kv_cache_memory_gib", "> 0")
        if self.max_loras < 1:
            raise bad("max_loras", ">= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise bad("max_cpu_loras", f">= --max-loras ({self.max_loras})")
        if self.max_lora_rank not in LORA_RANKS:
            raise bad("max_lora_rank", f"one of {', '.join(map(str, LORA_RANKS))}")
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise bad("pipeline_parallel_size", "1 with --enable-lora (LoRA under pipeline parallelism is not "
                      "supported yet)")
        if self.long_prefill_token_threshold is not None:
            if self.long_prefill_token_threshold < 1:
                raise bad("long_prefill_token_threshold", ">= 1 (the seeds' chunk_size)")
            if not self.enable_chunked_prefill:
                raise bad("long_prefill_token_threshold", "unset without chunked prefill (it caps a prefill chunk)")
        if self.cache_size_gb is not None:
            if self.cache_size_gb <= 0:
                raise bad("cache_size_gb", "> 0")
            if not self.enable_prefix_caching:
                raise bad("cache_size_gb", "unset without --enable-prefix-caching (it caps the prefix cache)")
        if self.profile not in (None, "auto"):
            from vserve.profiles import profile_names  # YAML file names only: cheap, no torch

            if self.profile not in profile_names():
                raise bad("profile", f"auto or one of {', '.join(profile_names())}")

    @classmethod
    def resolve(cls, flags: dict, profile=None) -> EngineConfig:
        """Merge defaults < profile < flags (None in flags means 'not given').

        profile: a dict of values, or a vserve.profiles.settings.ProfileSettings; when None and flags name a
        --profile, that profile's settings for flags' model. A profile value the engine does not support is not
        applied: its source says what the profile recommends, and why. Nor is a recommended quantization: it
        names a kind of checkpoint to serve, and the flag must match the checkpoint.
        """
        names = {f.name for f in fields(cls)} - {"sources"}
        for alias, name in cls.ALIASES.items():
            if flags.get(alias) is not None:
                if flags.get(name) is not None and flags[name] != flags[alias]:
                    raise ValueError(f"{alias} is another name for {name}: give one")
                flags = {**{k: v for k, v in flags.items() if k != alias}, name: flags[alias]}
            elif alias in flags:
                flags = {k: v for k, v in flags.items() if k != alias}
        unknown = set(flags) - names
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        if profile is None and flags.get("profile") is not None:
            cls(profile=flags["profile"])  # a bad name fails as a flag does
            from vserve.profiles.settings import profile_settings

            profile = profile_settings(flags["profile"], flags.get("model"))
        label, items = "profile", profile or {}
        if hasattr(profile, "values"):
            label, items = profile.label, profile.values
        values, sources = {}, {n: "default" for n in names}
        for name, value in items.items():
            if name not in names:
                continue
            if name == "quantization" and value is not None:  # a checkpoint's layout, not an engine setting
                sources[name] = f"default ({label} recommends {value}; serve a checkpoint quantized with it)"
                continue
            why = cls._unsupported(name, value)
            if why is None:
                values[name], sources[name] = value, label
            else:
                sources[name] = f"default ({label} recommends {value}; {why})"
        for name, value in flags.items():
            if value is not None:
                values[name], sources[name] = value, "flag"
        if hasattr(profile, "values") and flags.get("profile") == "auto":
            sources["profile"] = f"flag ({profile.profile.name})"
        cfg = cls(**values)
        cfg.sources = sources
        return cfg

    @classmethod
    def _unsupported(cls, name: str, value: object) -> str | None:
        """Why the engine refuses this one value (the parenthesis of its error when it has one), else None."""
        try:
            cls(**{name: value})
        except ValueError as e:
            found = re.search(r"\(([^)]*)\)", str(e))
            return found.group(1) if found else str(e)
        return None

    def describe(self) -> list[tuple[str, object, str]]:
        """(flag, value, source) rows for printing the resolved config."""
        def shown(name: str) -> object:
            value = getattr(self, name)
            return "***" if name == "hf_token" and value else value

        return [("--" + f.name.replace("_", "-"), shown(f.name), self.sources.get(f.name, "default"))
                for f in fields(self) if f.name != "sources"]
