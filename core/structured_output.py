"""Structured outputs: what a request asks for, its compilation in the front end, its matcher in the core.

Two grammar engines (`--structured-outputs-backend`): xgrammar (the default) and llguidance ("guidance", installed
with `pip install vserve[guidance]`); "auto" compiles with xgrammar and falls back to llguidance for a grammar
xgrammar refuses (e.g. a regex with a Unicode class or a flag group). The front end (InputProcessor) compiles a
request's grammar with the tokenizer it already holds, off the engine's critical path (the server does it on a
worker thread), through a cache keyed by the grammar; a grammar that cannot compile is a ValueError (HTTP 400) with
the compiler's message. The request carries the compiled grammar (xgrammar's serialized form, or llguidance's grammar
text) to the engine core, which keeps one matcher per sequence: before each sampling the rows with a grammar get
their allowed-token bitmask (filled on the host, applied on the device by kernels' apply_token_bitmask), and every
sampled token advances the matcher. A sequence whose grammar is complete finishes with "stop".
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict, deque
from copy import copy
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vserve.core.config import STRUCTURED_OUTPUTS_BACKENDS

if TYPE_CHECKING:
    import torch

MAX_WHITESPACE = 16  # characters of whitespace between two JSON elements
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of json (a JSON schema, as a dict or a string), regex, choice
    (a list of strings), grammar (EBNF / GBNF), json_object (any JSON object) or structural_tag (xgrammar's
    structural tag, a dict or its JSON string)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    # vserve's: the grammar starts after this token (a reasoning model's </think>; the server sets it)
    start_after_token_id: int | None = None
    # vserve's, for beam search (core/beam_search.py sets it): the beam's tokens so far, which the matcher accepts
    # before the step's mask; such a request's top logprobs are the allowed tokens' (the candidates a beam may take)
    beam_prefix: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("json must be a JSON schema (an object or its JSON string)")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The compiled-grammar cache key: the kind and its canonical text."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag") and isinstance(value, str):
            try:
                value = json.loads(value)  # the same schema however it is spaced
            except json.JSONDecodeError:
                pass  # compile() says what is wrong with it
        if isinstance(value, dict | list):
            value = json.dumps(value, sort_keys=True)
        return json.dumps([self.kind, value, self.disable_any_whitespace])


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.11


@dataclass(frozen=True)
class GrammarSpec:
    """What a request carries to the engine core: the grammar's cache key and, with the first request of its key
    only, xgrammar's serialized compiled grammar (up to megabytes: the core keeps it until the front end says to
    forget it). think_end_id: the grammar starts after this token (a reasoning model's end of thinking), or at once
    when None."""

    key: str
    compiled: str | None
    think_end_id: int | None = None
    beam_prefix: tuple[int, ...] | None = None  # StructuredOutputsParams.beam_prefix
    backend: str = "xgrammar"  # which engine compiled it: "xgrammar" or "guidance"


def _choice_grammar(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _guidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("--structured-outputs-backend guidance needs llguidance: pip install 'vserve[guidance]'") \
            from None
    return llguidance


def guidance_tokenizer_json(tokenizer) -> str:
    """The tokenizer as the tokenizers library serializes it (no padding or truncation), as llguidance reads it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("the guidance backend needs a fast (tokenizers) tokenizer")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class GrammarCompiler:
    """The front end's compiler: the tokenizer's grammar info per backend (built at the first structured request)
    and an LRU of compiled grammars by key. Thread-safe for the server's worker threads (both compilers are)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], max_cached: int = 256,
                 backend: str = "auto") -> None:
        if backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"--structured-outputs-backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                             f"got {backend!r}")
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.max_cached, self.backend = max_cached, backend
        self._info = None
        self._compiler = None
        self._ll_tokenizer = None
        self._ll_json: str | None = None
        self._cache: OrderedDict[str, tuple[str, str]] = OrderedDict()  # key -> (backend, compiled)
        self._lock = threading.Lock()  # the server compiles on worker threads: the cache and first build under it
        self._info_sent: set[str] = set()  # the backends whose tokenizer info the core holds
        self._sent: OrderedDict[str, None] = OrderedDict()  # the keys the core holds, least recently used first
        self.compile_seconds: deque[float] = deque()  # each cache miss's compile time (the metrics pop them)
        self.num_requests = 0  # requests compiled for, cache hits included

    def _check_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this engine has none (skip_tokenizer_init)")

    def _ensure(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._check_tokenizer()
                self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                 stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=2)
        return self._compiler

    def _ensure_guidance(self):
        llg = _guidance()
        with self._lock:
            if self._ll_tokenizer is None:
                self._check_tokenizer()
                text = guidance_tokenizer_json(self.tokenizer)
                self._ll_tokenizer = llg.LLTokenizer(text, n_vocab=self.vocab_size,
                                                     eos_token=self.stop_token_ids or None)
                self._ll_json = text
        return self._ll_tokenizer

    def tokenizer_info(self, backend: str) -> tuple[str, Any]:
        """What the core needs to build this backend's matchers: xgrammar's serialized TokenizerInfo, or the
        tokenizer's JSON, the vocabulary size and the stop tokens for llguidance."""
        if backend == "guidance":
            self._ensure_guidance()
            return backend, {"tokenizer": self._ll_json, "n_vocab": self.vocab_size, "eos": self.stop_token_ids}
        self._ensure()
        return backend, self._info.serialize_json()

    def core_commands(self, children: list) -> tuple[list[tuple], list[tuple]]:
        """The commands to send before and after these requests' "add": a backend's tokenizer info once; a grammar's
        compiled form goes with the first request of its key (later ones carry the key only) and the core is told
        to forget the least recently used key beyond max_cached. Called in send order, so the core holds what the
        front end believes it holds."""
        before: list[tuple] = []
        after: list[tuple] = []
        for r in children:
            spec = r.structured
            if spec is None:
                continue
            if spec.backend not in self._info_sent:
                before.append(("grammar_info", self.tokenizer_info(spec.backend)))
                self._info_sent.add(spec.backend)
            if spec.key in self._sent:
                self._sent.move_to_end(spec.key)
                r.structured = replace(spec, compiled=None)
            else:
                self._sent[spec.key] = None
                if len(self._sent) > self.max_cached:
                    after.append(("forget_grammar", self._sent.popitem(last=False)[0]))
        return before, after

    def compile(self, params: StructuredOutputsParams) -> GrammarSpec:
        key, think_end_id, prefix = params.key(), params.start_after_token_id, params.beam_prefix
        with self._lock:
            self.num_requests += 1
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return GrammarSpec(key, hit[1], think_end_id, prefix, hit[0])
        t0 = time.perf_counter()
        backend, compiled = self._compile_any(params)
        self.compile_seconds.append(time.perf_counter() - t0)
        with self._lock:
            self._cache[key] = (backend, compiled)
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return GrammarSpec(key, compiled, think_end_id, prefix, backend)

    def _compile_any(self, params: StructuredOutputsParams) -> tuple[str, str]:
        """(backend, compiled) by the engine's backend; auto: xgrammar, else llguidance where xgrammar refuses the
        grammar and llguidance (when installed) takes it; the error is xgrammar's when neither does."""
        if self.backend == "guidance":
            return "guidance", self._compile_guidance(params)
        try:
            return "xgrammar", self._compile_xgrammar(params)
        except ValueError:
            if self.backend == "xgrammar":
                raise
            try:  # a ValueError too where llguidance is not installed
                return "guidance", self._compile_guidance(params)
            except ValueError:
                pass
            raise

    def _compile_xgrammar(self, params: StructuredOutputsParams) -> str:
        compiler = self._ensure()
        try:
            grammar = self._compile(compiler, params)
        except (RuntimeError, ValueError, TypeError) as e:
            msg = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())  # xgrammar's "[time] file.cc:line: " prefix
            raise ValueError(f"the {params.kind} structured output does not compile: {msg}") from None
        return grammar.serialize_json()

    def _compile_guidance(self, params: StructuredOutputsParams) -> str:
        llg = _guidance()
        tokenizer = self._ensure_guidance()
        try:
            grammar = guidance_grammar(llg, params)
            is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        except (AssertionError, KeyError, RuntimeError, ValueError, TypeError) as e:  # KeyError: a tag's missing key
            is_error, messages = True, [f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)]
        if is_error:
            raise ValueError(f"the {params.kind} structured output does not compile (llguidance): "
                             f"{messages[0].strip()}")
        return grammar

    @staticmethod
    def _compile(compiler, p: StructuredOutputsParams):
        import xgrammar as xgr

        # JSON's whitespace: free (pretty-printing) but at most MAX_WHITESPACE characters between two elements, so a
        # sampled sequence cannot run on in whitespace until max_tokens (it did at temperature 1); compact JSON with
        # disable_any_whitespace
        ws = {"any_whitespace": False} if p.disable_any_whitespace else {"max_whitespace_cnt": MAX_WHITESPACE}
        if p.json is not None:
            schema = p.json if isinstance(p.json, str) else json.dumps(p.json)
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the schema is not valid JSON: {e}") from None
            return compiler.compile_grammar(json_string_fix(xgr.Grammar.from_json_schema(schema, **ws)))
        if p.json_object:  # any object (not strict: any properties)
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
        if p.regex is not None:
            return compiler.compile_regex(p.regex)
        if p.choice is not None:
            return compiler.compile_grammar(_choice_grammar(p.choice))
        if p.grammar is not None:
            return compiler.compile_grammar(p.grammar)
        tag = p.structural_tag if isinstance(p.structural_tag, str) else json.dumps(p.structural_tag)
        return compiler.compile_grammar(json_string_fix(xgr.Grammar.from_structural_tag(tag)))


# xgrammar (0.2.9) writes a string with minLength/maxLength as a count of this character class, which lets raw
# control characters (a tab, \x01) into the JSON string, which JSON forbids (json.loads refuses it); its unbounded
# strings use the class below. A length-bounded string stays without escapes, as xgrammar has it.
_COUNTED_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\]'


def json_string_fix(grammar):
    """A grammar from a JSON schema (or a structural tag holding schemas) whose length-bounded strings refuse JSON's
    forbidden control characters: the grammar itself where it has none, else its EBNF with the class replaced."""
    text = str(grammar)
    return text.replace(_COUNTED_CHAR, _JSON_CHAR) if _COUNTED_CHAR in text else grammar


# JSON's whitespace under llguidance: as under xgrammar, at most MAX_WHITESPACE characters between two elements
_GUIDANCE_WS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}"}


def guidance_grammar(llg, p: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of a request's structured output. Structural tags: the form with
    "structures" (begin, schema, end) and "triggers", as vLLM's guidance backend takes them."""
    ws = {"whitespace_flexible": False} if p.disable_any_whitespace else _GUIDANCE_WS
    if p.json is not None or p.json_object:
        schema = p.json if p.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the schema is not valid JSON: {e}") from None
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=ws)
    if p.regex is not None:
        return llg.LLMatcher.grammar_from_regex(p.regex)
    if p.choice is not None:
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in p.choice))
    if p.grammar is not None:
        return llg.grammar_from("grammar", p.grammar)  # Lark, or GBNF / EBNF (root ::= ...) converted to Lark
    tag = json.loads(p.structural_tag) if isinstance(p.structural_tag, str) else p.structural_tag
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag.get("triggers"):
        raise ValueError('the guidance backend takes structural tags as {"structures": [{"begin", "schema", '
                         '"end"}, ...], "triggers": [...]}')
    tags = []
    for s in tag["structures"]:
        trigger = next((t for t in tag["triggers"] if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger starts the structural tag's begin {s['begin']!r}")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema", {}), end=s["end"]))
    return llg.StructTag.to_grammar(tags)


@dataclass
class GrammarState:
    """One sequence's matcher in the core (xgrammar's GrammarMatcher or llguidance's LLMatcher); `active` turns on
    at think_end_id (reasoning models)."""

    matcher: Any
    think_end_id: int | None = None
    active: bool = True
    allowed_logprobs: bool = False  # a beam search step's: top logprobs among the allowed tokens only
    guidance: bool = False  # an llguidance matcher
    # llguidance's: its tokenizer's stop tokens that this request does not stop on (ignore_eos), cleared from the
    # mask, so the grammar ends the request where xgrammar's (built with the request's own stops) does
    clear_tokens: tuple[int, ...] = ()

    def accept(self, token: int) -> bool:
        """Advance with a sampled token; whether the grammar is now complete (the sequence stops)."""
        if not self.active:
            self.active = token == self.think_end_id
            return False
        if self.guidance:
            # stopped: complete, nothing but a stop token may follow
            return not self.matcher.consume_token(token) or self.matcher.is_stopped()
        if not self.matcher.accept_token(token):
            # only a token the mask allowed is sampled; one that is not means the grammar cannot go on
            return True
        return self.matcher.is_terminated()

    def has_mask(self) -> bool:
        """Whether the next step's tokens are constrained: active and not ended (or in error)."""
        if not self.active:
            return False
        return not self.matcher.is_error() if self.guidance else not self.matcher.is_terminated()


def fill_threads() -> int:
    """Threads of the core's bitmask fill: $VSERVE_GRAMMAR_THREADS, else half the cores this process may use, at
    most 8. Not every core: the fill ends with its slowest thread, and the front end (detokenizing the same step's
    tokens), the core's own thread and the CUDA driver's need cores at the same time."""
    import os

    given = os.environ.get("VSERVE_GRAMMAR_THREADS")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"VSERVE_GRAMMAR_THREADS must be a positive integer, got {given!r}")
        return int(given)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(8, usable // 2))


@dataclass
class StructuredOutputManager:
    """The core's side: each backend's tokenizer info, the grammars by key (those the front end sent and has not
    told it to forget), a matcher per sequence, the step's bitmask."""

    vocab_size: int
    _info: Any = None  # xgrammar's TokenizerInfo
    _ll_tokenizer: Any = None  # llguidance's LLTokenizer
    _ll_stops: tuple[int, ...] = ()  # its stop tokens
    _grammars: dict = field(default_factory=dict)  # key -> xgrammar CompiledGrammar, or an llguidance LLMatcher
    _bitmask: Any = None  # a host torch.Tensor, grown as needed
    _batch: Any = None  # xgrammar's BatchGrammarMatcher: the rows' masks filled on several threads
    _executor: Any = None  # llguidance's LLExecutor, likewise
    # host time the grammars cost the core (CoreStats.grammar): mask fills (once per step with a constrained row:
    # seconds, calls, rows) and matcher advances (seconds, tokens)
    fill_seconds: float = 0.0
    fill_calls: int = 0
    fill_rows: int = 0
    accept_seconds: float = 0.0
    accept_tokens: int = 0

    def times(self) -> tuple[float, int, int, float, int]:
        return self.fill_seconds, self.fill_calls, self.fill_rows, self.accept_seconds, self.accept_tokens

    def accept(self, state: GrammarState, token: int) -> bool:
        """state.accept(token), timed."""
        t0 = time.perf_counter()
        done = state.accept(token)
        self.accept_seconds += time.perf_counter() - t0
        self.accept_tokens += 1
        return done

    def set_tokenizer_info(self, backend: str, info: Any) -> None:
        """GrammarCompiler.tokenizer_info's (backend, info)."""
        if backend == "guidance":
            import llguidance as llg

            self._ll_tokenizer = llg.LLTokenizer(info["tokenizer"], n_vocab=info["n_vocab"],
                                                 eos_token=info["eos"] or None)
            self._ll_stops = tuple(info["eos"])
            return
        import xgrammar as xgr

        self._info = xgr.TokenizerInfo.deserialize_json(info)

    def receive(self, spec: GrammarSpec) -> None:
        """Keep the compiled grammar the first request of a key carries (llguidance's: a matcher at its start,
        which each request's matcher copies: building one costs about a millisecond, a copy microseconds)."""
        if spec.compiled is None:
            return
        if spec.backend == "guidance":
            import llguidance as llg

            if self._ll_tokenizer is None:
                raise RuntimeError("a structured request reached the core before the tokenizer's grammar info")
            matcher = llg.LLMatcher(self._ll_tokenizer, spec.compiled, log_level=0)
            if matcher.is_error():
                raise RuntimeError(f"llguidance refused a grammar the front end compiled: {matcher.get_error()}")
            self._grammars[spec.key] = matcher
            return
        import xgrammar as xgr

        if self._info is None:
            raise RuntimeError("a structured request reached the core before the tokenizer's grammar info")
        self._grammars[spec.key] = xgr.CompiledGrammar.deserialize_json(spec.compiled, self._info)

    def new_state(self, spec: GrammarSpec, stop_token_ids: set[int]) -> GrammarState:
        grammar = self._grammars.get(spec.key)
        if grammar is None:
            raise RuntimeError(f"the core holds no compiled grammar for key {spec.key[:80]!r}")
        if spec.backend == "guidance":
            state = GrammarState(grammar.deep_copy(), spec.think_end_id, active=spec.think_end_id is None,
                                 allowed_logprobs=spec.beam_prefix is not None, guidance=True,
                                 clear_tokens=tuple(t for t in self._ll_stops if t not in stop_token_ids))
        else:
            import xgrammar as xgr

            # the request's own stop tokens end the grammar (ignore_eos: none, so the grammar ends without one)
            stops = sorted(stop_token_ids)
            matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stops or None,
                                         terminate_without_stop_token=not stops)
            state = GrammarState(matcher, spec.think_end_id, active=spec.think_end_id is None,
                                 allowed_logprobs=spec.beam_prefix is not None)
        for token in spec.beam_prefix or ():  # the beam's tokens (each one its mask allowed at its step)
            state.accept(token)
        return state

    def forget(self, key: str) -> None:
        self._grammars.pop(key, None)

    def bitmask(self, states: list[GrammarState | None]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed-token bitmask of the rows whose grammar is active (host int32, one row each) and their row
        indices in the batch, or None when no row is constrained."""
        rows = [i for i, s in enumerate(states) if s is not None and s.has_mask()]
        if not rows:
            return None
        import torch

        t0 = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            n = max(len(rows), 2 * (0 if self._bitmask is None else self._bitmask.shape[0]), 8)
            self._bitmask = torch.empty(n, words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        mask = self._bitmask[:len(rows)]
        guided = [j for j, i in enumerate(rows) if states[i].guidance]
        if not guided:
            self._fill_xgrammar(mask, [states[i].matcher for i in rows], None)
        else:
            at = [j for j, i in enumerate(rows) if not states[i].guidance]
            if at:
                self._fill_xgrammar(mask, [states[rows[j]].matcher for j in at], at)
            self._fill_guidance(mask, [states[rows[j]] for j in guided], guided)
        self.fill_seconds += time.perf_counter() - t0
        self.fill_calls += 1
        self.fill_rows += len(rows)
        return mask, rows

    def _fill_xgrammar(self, mask, matchers: list, at: list[int] | None) -> None:
        """The xgrammar matchers' masks at mask rows `at` (None: rows 0, 1, ...)."""
        if len(matchers) < 8:
            for j, m in enumerate(matchers):
                m.fill_next_token_bitmask(mask, j if at is None else at[j])
            return
        # a row's mask costs ~10 us (more at a JSON structure's edges): spread the rows over cores
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=fill_threads())
        self._batch.batch_fill_next_token_bitmask(matchers, mask, indices=at)

    def _fill_guidance(self, mask, states: list[GrammarState], at: list[int]) -> None:
        """The llguidance rows' masks at rows `at`, on its executor's threads; then each row's cleared tokens."""
        if self._executor is None:
            import llguidance as llg

            self._executor = llg.LLExecutor(num_threads=fill_threads())
        row_bytes = mask.shape[1] * 4
        self._executor.unsafe_compute_mask_ptr([(s.matcher, j) for s, j in zip(states, at)], mask.data_ptr(),
                                               row_bytes, mask.shape[0])
        words = None
        for s, j in zip(states, at):
            if s.clear_tokens:
                if words is None:
                    words = mask.numpy().view("uint32")
                for t in s.clear_tokens:
                    words[j, t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF
