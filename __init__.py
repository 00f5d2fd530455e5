"""vserve: a CLI-first LLM serving and operations toolkit (paged KV cache, continuous batching).

`from vserve import LLM, SamplingParams` imports torch lazily, so `vserve --help` stays fast.
"""

import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"

# The repository root is this package (pyproject: package-dir {"vserve" = "."}). Where the root is also on sys.path
# (`python -m ...` or `python -c` run in a checkout, `python -m pytest`), its folders import as top-level packages
# too and shadow installed distributions of the same name: transformers >= 5.25 imports the `kernels` distribution,
# and got vserve's kernels/ folder. Nothing is imported from the root but through `vserve`: take it off the path.
_ROOT = _Path(__file__).resolve().parent
_sys.path[:] = [p for p in _sys.path if _Path(p or ".").resolve() != _ROOT]

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           "StructuredOutputsParams", "GuidedDecodingParams", "LoRARequest", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from vserve.core.llm import LLM

        return LLM
    if name == "SamplingParams":
        from vserve.core.sampling_params import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from vserve.core.beam_search import BeamSearchParams

        return BeamSearchParams
    if name in ("RequestOutput", "CompletionOutput"):
        from vserve.core import request

        return getattr(request, name)
    if name in ("StructuredOutputsParams", "GuidedDecodingParams"):
        from vserve.core import structured_output

        return getattr(structured_output, name)
    if name == "LoRARequest":
        from vserve.core.lora.adapter import LoRARequest

        return LoRARequest
    if name == "EngineConfig":
        from vserve.core.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'vserve' has no attribute {name!r}")
