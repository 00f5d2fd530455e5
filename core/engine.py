"""LLMEngine: the offline front end (add_request / abort_request / step) over an EngineCore.

Prompts are tokenized and validated here (InputProcessor), sent to the core as token ids, and the core's per-step
tokens come back through the OutputProcessor, which detokenizes, finds stop strings and makes the RequestOutputs.
The core runs in this process (`recv()` steps it: the CPU default) or in an engine process of its own (the GPU
default), through the one protocol of core/core_client.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vserve.core.config import EngineConfig
from vserve.core.core_client import ProcClient, start_core
from vserve.core.lora.adapter import LoRARequest
from vserve.core.lora.registry import LoRARegistry, set_adapter
from vserve.core.messages import CoreInfo, CoreStats, EngineStats
from vserve.core.output_processor import OutputProcessor, RequestState
from vserve.core.request import Request, RequestOutput
from vserve.core.sampling_params import SamplingParams
from vserve.ops import startup

if TYPE_CHECKING:
    import torch

    from vserve.core.engine_core import EngineCore

__all__ = ["EngineStats", "LLMEngine"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from vserve.core.hub import resolve_model_files

        with startup.phase("resolve model"):
            config = resolve_model_files(config)  # hub ids -> cached snapshot paths, once for both halves
        self.config = config
        self.client, self.processor, _ = start_core(config, serving=False)
        self.info: CoreInfo = self.client.info
        self.tokenizer = self.processor.tokenizer
        self.model_config = self.processor.model_config
        self.max_model_len = self.processor.max_model_len
        self.stop_token_ids = self.processor.stop_token_ids
        self.output = OutputProcessor(self.tokenizer)
        self.loras = LoRARegistry.for_config(config, self.model_config)
        self.last_stats: CoreStats | None = None

    @property
    def core(self) -> EngineCore | None:
        """The core, when it runs in this process (tests and tools that look inside it)."""
        return getattr(self.client, "core", None)

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.info.dtype)

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device(self.info.device)

    @property
    def eos_token_id(self) -> int | None:
        return self.processor.eos_token_id

    @property
    def last_finished(self) -> dict[str, list[RequestState]]:
        return self.output.last_finished

    # ---- counters (live for an in-process core, else as of the core's last message) ---------------------------
    def stats(self) -> EngineStats:
        core = self.core
        if core is not None:
            return core.stats()
        return self.last_stats.engine if self.last_stats is not None else EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)

    def _counter(self, name: str) -> int:
        core = self.core
        if core is not None:
            return getattr(core, name)
        return getattr(self.last_stats, name) if self.last_stats is not None else 0

    @property
    def num_generated_tokens(self) -> int:
        return self._counter("num_generated_tokens")

    @property
    def num_computed_prompt_tokens(self) -> int:
        return self._counter("num_computed_prompt_tokens")

    @property
    def last_step_tokens(self) -> int:
        return self._counter("last_step_tokens")

    # ---- requests -------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.processor.tokenize(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        """Validate, then enqueue params.n child requests; nothing is enqueued if anything is invalid."""
        self.submit(self.make_requests(request_id, prompt, params, cache_salt))

    def make_requests(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                      lora_adapter: str | None = None) -> list[Request]:
        """Tokenize and validate (ValueError for bad input) without touching engine state. The adapter: a
        LoRARequest or the name of one added with add_lora_adapter (None: the base model)."""
        lr = self.loras.resolve(lora_request, lora_adapter)
        return set_adapter(self.processor.make_requests(request_id, prompt, params, cache_salt), lr)

    # ---- LoRA adapters by name (the seeds' API) ------------------------------------------------------------------
    def add_lora_adapter(self, name: str, path: str) -> LoRARequest:
        lr = self.loras.add(name, path)
        self._send(("load_lora", (lr.lora_int_id, lr.lora_name, lr.lora_path)))
        return lr

    def remove_lora_adapter(self, name: str) -> None:
        self._send(("remove_lora", self.loras.remove(name).lora_int_id))

    def list_lora_adapters(self) -> list[str]:
        return list(self.loras.by_name)

    def submit(self, children: list[Request]) -> None:
        """Enqueue the children of one request (made by make_requests)."""
        self.output.add(children)
        for command in self.processor.core_commands(children):
            self._send(command)

    def abort_request(self, request_id: str) -> None:
        ids = self.output.abort(request_id)
        if ids:
            self._send(("abort", ids))

    def has_unfinished_requests(self) -> bool:
        return self.output.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self, finished_only: bool = False, delta: bool = False) -> list[RequestOutput]:
        """The core's next step, as the outputs of the requests that changed (or, with finished_only, of those that
        finished: offline batches need no per-step outputs). With delta, each output holds only what is new since
        that request's last output (tokens, text, logprobs).

        Under async scheduling a step's tokens come back from the next call, and a request that stopped may have
        been scheduled once more: that token is dropped."""
        self.output.last_finished = {}
        msg = self.client.recv(block=False) if self.core is not None else self.client.recv()
        if msg is None:
            return []
        if msg[0] == "dead":
            raise RuntimeError(f"the engine stopped: {msg[1]}")
        if msg[0] == "stats":
            self.last_stats = msg[1]
            return []
        _, core_outputs, self.last_stats = msg
        outs, aborts = self.output.process(core_outputs, delta, finished_only)
        if aborts:
            self._send(("abort", aborts))
        return outs

    def _send(self, command: tuple) -> None:
        self.client.send(command)
        if self.core is not None:  # this thread runs the core: apply at once (a stopped request frees its blocks now)
            self.client.loop.apply_commands()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the engine process, or the other tensor-parallel ranks of an in-process core."""
        client = getattr(self, "client", None)
        if client is None:
            return
        if isinstance(client, ProcClient):
            client.shutdown(5.0 if graceful else 0.0)
        else:
            client.core.shutdown(graceful)

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if ProcClient is not None and isinstance(client, ProcClient):  # None: module globals torn down at exit
            client.kill()
