"""`LLM`: the offline API (vLLM's shape) over one LLMEngine."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rich.progress import TextColumn

from vserve.core.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from vserve.core.config import EngineConfig
from vserve.core.engine import LLMEngine
from vserve.core.lora.adapter import LoRARequest
from vserve.core.request import RequestOutput
from vserve.core.sampling_params import SamplingParams
from vserve.ops import startup
from vserve.ops.progress import make_progress

# A text, token ids, or vLLM's prompt dicts: {"prompt": text} / {"prompt_token_ids": ids}, each with an optional
# "cache_salt" (the request shares cached prefix blocks only with requests of the same salt).
Prompt = str | list[int] | dict
Message = dict[str, str]


class LLM:
    """`LLM(model=None, **engine_args)`; model None serves the embedded default (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.llm_engine = LLMEngine(EngineConfig.resolve({"model": model, **engine_args}))
        startup.write_report()  # for `vserve bench startup`, when it asks
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """vLLM's offline metrics API: a snapshot of the engine's gauges and counters as Metric(name, value), with
        vLLM's names under vserve: and the seeds' names (running_requests, gpu_utilization, memory_utilization,
        block_utilization, cache_hit_rate, ...); also indexable by name (`llm.get_metrics()["cache_hit_rate"]`)."""
        from vserve.core.server.metrics import seed_values

        engine = self.llm_engine
        s = engine.stats()
        values = {"vserve:num_requests_running": s.num_running, "vserve:num_requests_waiting": s.num_waiting,
                  "vserve:kv_cache_usage_perc": s.kv_cache_usage, "vserve:prefix_cache_queries": s.prefix_cache_queries,
                  "vserve:prefix_cache_hits": s.prefix_cache_hits, "vserve:num_preemptions": s.num_preemptions,
                  "vserve:prompt_tokens": engine.num_computed_prompt_tokens,
                  "vserve:generation_tokens": engine.num_generated_tokens, **seed_values(engine)}
        return MetricList(Metric(name, value) for name, value in values.items())

    def sanitize_input(self, text: str) -> str:
        """text with every special-token string of this model's tokenizer neutralised (core/sanitize.py): it can
        never tokenize to a special token, so untrusted text cannot inject template tokens."""
        from vserve.core.sanitize import sanitize_input

        if self.llm_engine.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): nothing to sanitize against")
        return sanitize_input(self.llm_engine.tokenizer, text)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 lora_adapter: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Prompts: a str, a list of token ids, a prompt dict, or a list of them. lora_request (vLLM's) or
        lora_adapter (the name given to add_lora_adapter): one adapter for every prompt or a list, one per prompt
        (None: the base model); needs enable_lora=True."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        loras, names = _per_prompt(lora_request, len(prompts), "lora_request"), \
            _per_prompt(lora_adapter, len(prompts), "lora_adapter")
        # Validate and tokenize every prompt before enqueueing any, so a bad one leaves nothing half-done.
        batch = []
        for p, sp, lr, name in zip(prompts, sampling_params, loras, names):
            prompt, salt = _unpack(p)
            batch.append(engine.make_requests(str(next(self._ids)), prompt, sp, salt, lr, name))
        order = []
        try:
            for children in batch:
                engine.submit(children)
                order.append(children[0].parent_id)
            return self._run(order, use_tqdm)
        except BaseException:
            for rid in order:
                engine.abort_request(rid)
            raise

    # ---- LoRA adapters by name (the seeds' API; vLLM's is lora_request=LoRARequest(...)) --------------------------
    def add_lora_adapter(self, name: str, path: str) -> None:
        """Check a PEFT adapter folder and name it for generate(..., lora_adapter=name); it loads into the engine
        when a request first uses it. ValueError for a bad folder, a rank above --max-lora-rank, a name in use."""
        self.llm_engine.add_lora_adapter(name, path)

    def remove_lora_adapter(self, name: str) -> None:
        self.llm_engine.remove_lora_adapter(name)

    def list_lora_adapters(self) -> list[str]:
        return self.llm_engine.list_lora_adapters()

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's beam search (HF transformers' semantics for length_penalty and stopping): core/beam_search.py."""
        return run_beam_search(self, prompts, params)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             lora_adapter: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """One conversation or a list of them, through the model's chat template (or `chat_template`); the
        adapters as for generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, chat_template, add_generation_prompt) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request, lora_adapter=lora_adapter)

    def apply_chat_template(self, conversation: list[Message], chat_template: str | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        tok = self.llm_engine.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template")
        text = tok.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
        return tok(text, add_special_tokens=False).input_ids

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        n0 = engine.num_generated_tokens
        show = use_tqdm and len(order) > 1
        with make_progress(TextColumn("{task.fields[tps]} tok/s")) as progress:
            task = progress.add_task("Generating", total=len(order), tps="0", visible=show)
            while len(done) < len(order):
                for out in engine.step(finished_only=True):
                    if out.finished:
                        done[out.request_id] = out
                        progress.advance(task)
                tps = (engine.num_generated_tokens - n0) / max(time.perf_counter() - start, 1e-9)
                progress.update(task, tps=f"{tps:,.0f}")
        return [done[rid] for rid in order]


def _per_prompt(value, n: int, name: str) -> list:
    """One value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list | tuple):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"got {len(value)} {name} entries for {n} prompts")
    return list(value)


@dataclass(frozen=True)
class Metric:
    name: str
    value: float


class MetricList(list):
    """LLM.get_metrics()'s list of Metric, also looked up by name."""

    def __getitem__(self, key):
        if isinstance(key, str):
            for m in self:
                if m.name == key:
                    return m.value
            raise KeyError(key)
        return super().__getitem__(key)


def _unpack(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """(text or token ids, cache salt) of one prompt."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f'a prompt dict holds "prompt" or "prompt_token_ids" (and optionally "cache_salt"), got '
                         f"keys {sorted(prompt)}")
    return prompt.get("prompt", prompt.get("prompt_token_ids")), prompt.get("cache_salt")
