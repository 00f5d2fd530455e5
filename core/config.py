"""Engine configuration: defaults < profile < explicit flags, remembering where each value came from."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

BLOCK_SIZES = (16, 32, 64, 128, 256)
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class EngineConfig:
    """Every engine flag, named as vLLM names it (`--max-num-seqs` -> max_num_seqs)."""

    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    quantization: str | None = None
    load_format: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu
    kv_cache_memory_gib: float | None = None  # CPU KV cache size; None: 1 GiB or a quarter of free RAM
    num_kv_blocks: int | None = None  # force the number of KV blocks (tests, experiments)
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            flag = "--" + name.replace("_", "-")
            return ValueError(f"{flag} must be {rule}, got {getattr(self, name)!r}")

        if self.block_size not in BLOCK_SIZES:
            raise bad("block_size", f"one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"one of {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"one of {', '.join(LOAD_FORMATS)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", ">= 1")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", ">= 1")
        if self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", ">= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "in (0, 1]")
        if self.tensor_parallel_size != 1:
            raise bad("tensor_parallel_size", "1 (tensor parallelism is not implemented yet)")
        if self.quantization is not None:
            raise bad("quantization", "unset (quantized serving is not implemented yet)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", "auto, cpu or cuda")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", ">= 1")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise bad("kv_cache_memory_gib", "> 0")

    @classmethod
    def resolve(cls, flags: dict, profile: dict | None = None) -> EngineConfig:
        """Merge defaults < profile < flags (None in flags means 'not given')."""
        names = {f.name for f in fields(cls)} - {"sources"}
        unknown = set(flags) - names
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        values, sources = {}, {n: "default" for n in names}
        for name, value in (profile or {}).items():
            if name in names:
                values[name], sources[name] = value, "profile"
        for name, value in flags.items():
            if value is not None:
                values[name], sources[name] = value, "flag"
        cfg = cls(**values)
        cfg.sources = sources
        return cfg

    def describe(self) -> list[tuple[str, object, str]]:
        """(flag, value, source) rows for printing the resolved config."""
        return [("--" + f.name.replace("_", "-"), getattr(self, f.name), self.sources.get(f.name, "default"))
                for f in fields(self) if f.name != "sources"]
