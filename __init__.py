"""vserve: a CLI-first LLM serving and operations toolkit (paged KV cache, continuous batching).

`from vserve import LLM, SamplingParams` imports torch lazily, so `vserve --help` stays fast.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from vserve.core.llm import LLM

        return LLM
    if name == "SamplingParams":
        from vserve.core.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from vserve.core import request

        return getattr(request, name)
    if name == "EngineConfig":
        from vserve.core.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'vserve' has no attribute {name!r}")
