"""Route handlers: completions, chat completions (plain and SSE streaming) and embeddings."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vserve.core.async_engine import AsyncLLM, EngineDeadError
from vserve.core.request import CompletionOutput, RequestOutput
from vserve.core.sanitize import sanitize_input
from vserve.core.server.chat_output import ChatOutputParser
from vserve.core.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    now,
    random_id,
    usage,
)

UNTRUSTED_ROLES = ("user", "tool")  # their content is neutralised unless --allow-special-tokens-in-content


def render_chat(engine, conversation: list[dict], settings, add_generation_prompt: bool = True,
                tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """conversation: ChatMessage.for_template() dicts; tools: OpenAI tool definitions, which the template renders."""
    tok = engine.tokenizer
    template = settings.chat_template
    if template is None and not getattr(tok, "chat_template", None):
        raise ValueError("this model has no chat template; start the server with --chat-template FILE")
    if not getattr(settings, "allow_special_tokens_in_content", False):  # untrusted roles cannot inject turns
        conversation = [{**m, "content": sanitize_input(tok, m["content"])} if m["role"] in UNTRUSTED_ROLES else m
                        for m in conversation]
    try:
        return tok.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, tools=tools,
                                       **(template_kwargs or {}))
    except Exception as e:  # jinja raises its own errors for conversations the template rejects
        raise ValueError(f"the chat template rejected these messages: {e}") from None


def _reasoning_end_id(tokenizer, settings, prompt_ids: list[int]) -> int | None:
    """With a reasoning parser: the token after which a structured output starts (</think>), unless the prompt
    already closed the thinking (e.g. Qwen3's template with enable_thinking false)."""
    if not settings.reasoning_parser:
        return None
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    unk = tokenizer.unk_token_id
    if end is None or end == unk:
        return None
    last_start = max((i for i, t in enumerate(prompt_ids) if t == start), default=-1)
    if end in prompt_ids[last_start + 1:]:
        return None
    return end


async def _until_disconnect(raw: Request) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(0.25)


async def _collect(gen: AsyncIterator[RequestOutput], raw: Request) -> RequestOutput | None:
    """The final output, or None if the client went away first (the request is then aborted)."""

    async def last():
        final = None
        async for final in gen:  # noqa: B007 (the last output is the final one)
            pass
        return final

    work = asyncio.ensure_future(last())
    watch = asyncio.ensure_future(_until_disconnect(raw))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None
    finally:
        watch.cancel()
        await gen.aclose()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream_error(e: Exception) -> str:
    """An error after the stream's 200: a dead engine is the 503 it would have been before the headers."""
    if isinstance(e, EngineDeadError):
        return _sse({"error": {"message": str(e), "type": "service_unavailable", "param": None, "code": 503}})
    return _sse({"error": {"message": str(e), "type": "invalid_request_error", "param": None, "code": 400}})


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


# ---- completions ---------------------------------------------------------------------------------------------
def _legacy_logprobs(tokenizer, token_ids: list[int], entries, n_top: int, offset: int) -> dict:
    """The legacy completions format of tokens and their logprob dicts; an entry None (a prompt's first token) has
    a null logprob and null top_logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tok_id, entry in zip(token_ids, entries):
        text = _token_text(tokenizer, tok_id)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tok_id].logprob)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[: max(n_top, 0)]
        tops.append({_token_text(tokenizer, t): lp.logprob for t, lp in ranked} if n_top else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _vllm_prompt_logprobs(tokenizer, out: RequestOutput, n_top: int) -> list:
    """vLLM's prompt_logprobs field: None for the first token, then {token id: {logprob, rank, decoded_token}} of the
    prompt's token and the top n_top."""
    return [None if entry is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": _token_text(tokenizer, t)}
             for t, lp in entry.items() if t == tok or lp.rank <= n_top}
            for tok, entry in zip(out.prompt_token_ids, out.prompt_logprobs or [])]


def _completion_logprobs(tokenizer, comp: CompletionOutput, n_top: int, offset: int) -> dict:
    return _legacy_logprobs(tokenizer, comp.token_ids, comp.logprobs or [], n_top, offset)


def _echo_logprobs(tokenizer, out: RequestOutput, comp: CompletionOutput, n_top: int) -> dict:
    """echo with logprobs: the prompt's tokens (the first with null logprobs) then the completion's, as OpenAI's
    legacy completions and vLLM give them (what evaluation harnesses score)."""
    lp = _legacy_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs, n_top, 0)
    rest = _completion_logprobs(tokenizer, comp, n_top, sum(map(len, lp["tokens"])))
    return {k: lp[k] + rest[k] for k in lp}


async def create_completion(engine: AsyncLLM, body: CompletionRequest, raw: Request, settings, lora=None):
    if body.suffix is not None:
        raise ValueError("suffix is not supported")
    if body.use_beam_search:
        from vserve.core.server.beam_search import create_beam_search_completion

        if lora is not None:
            raise ValueError("use_beam_search cannot be used with a LoRA adapter (not supported yet)")

        return await create_beam_search_completion(engine, body, raw, settings)
    best_of = body.best_of or body.n
    if best_of < body.n:
        raise ValueError(f"best_of must be >= n, got best_of={best_of}, n={body.n}")
    if body.stream and best_of != body.n:
        raise ValueError("best_of cannot be used with stream")
    prompts = body.prompts()
    want_lp = body.logprobs is not None or best_of > body.n
    score_only = body.max_tokens == 0  # the prompt's logprobs only: one token is generated and not shown
    if score_only and not body.echo:
        raise ValueError("max_tokens 0 needs echo=true (it returns the prompt and, with logprobs, its logprobs)")
    if score_only and body.stream:
        raise ValueError("max_tokens 0 cannot be used with stream")
    sp = body.sampling_params(1 if score_only else body.max_tokens, (body.logprobs or 0) if want_lp else None,
                              n=best_of)
    if body.echo and body.logprobs is not None or body.prompt_logprobs is not None:
        sp = replace(sp, prompt_logprobs=max(body.logprobs or 0 if body.echo else 0, body.prompt_logprobs or 0))
    base_id = random_id("cmpl")
    created, model = now(), settings.served_model_name if lora is None else lora.lora_name
    gens = []
    for i, p in enumerate(prompts):
        gens.append(engine.generate(f"{base_id}-{i}", p, sp, stream=body.stream, cache_salt=body.cache_salt,
                                    lora_request=lora))
    tokenizer = engine.engine.tokenizer

    if body.stream:
        return StreamingResponse(_stream_completion(engine, body, gens, base_id, created, model, tokenizer),
                                 media_type="text/event-stream")

    try:
        # The first __anext__ of each generator validates and enqueues its prompt.
        outs = await asyncio.gather(*[_collect(g, raw) for g in gens])
    except BaseException:
        for g in gens:
            await g.aclose()
        raise
    if any(o is None for o in outs):
        return JSONResponse({}, status_code=499)
    choices, n_prompt, n_completion, n_cached = [], 0, 0, 0
    for pi, out in enumerate(outs):
        n_prompt += len(out.prompt_token_ids)
        n_cached += out.num_cached_tokens
        comps = out.outputs
        if score_only:
            comps = [CompletionOutput(c.index, "", [], 0.0, [], "length") for c in comps]
        n_completion += sum(len(c.token_ids) for c in comps)
        if best_of > body.n:
            comps = sorted(comps, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[: body.n]
        prefix = ""
        if body.echo:
            p = prompts[pi]
            prefix = p if isinstance(p, str) else tokenizer.decode(p)
        for j, comp in enumerate(comps):
            lp = None
            if body.logprobs is not None:
                lp = (_echo_logprobs(tokenizer, out, comp, body.logprobs) if body.echo else
                      _completion_logprobs(tokenizer, comp, body.logprobs, 0))
            choice = {"index": pi * body.n + j, "text": prefix + comp.text, "logprobs": lp,
                      "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(tokenizer, out, body.prompt_logprobs)
            choices.append(choice)
    return {"id": base_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(n_prompt, n_completion, n_cached)}


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generators' outputs as they come (one generator, the usual case, is read directly)."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, g):
        try:
            async for out in g:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


async def _stream_completion(engine, body: CompletionRequest, gens, base_id, created, model, tokenizer):
    """Each output is a delta: only its new text and tokens are handled, so a chunk costs the same however long
    the completion already is."""
    sent_text: dict[tuple[int, int], int] = {}  # characters sent per choice: the logprobs' text offsets
    held: dict[tuple[int, int], CompletionOutput] = {}  # tokens whose text is not complete yet
    n_prompt = n_completion = n_cached = 0
    try:
        async for pi, out in _merge(gens):
            for comp in out.outputs:
                key = (pi, comp.index)
                if key not in sent_text:
                    sent_text[key] = 0
                    if body.echo:
                        p = body.prompts()[pi]
                        plp = None
                        if body.logprobs is not None and out.prompt_logprobs is not None:
                            plp = _legacy_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs,
                                                   body.logprobs, 0)
                        echoed = p if isinstance(p, str) else tokenizer.decode(p)
                        sent_text[key] = len(echoed)
                        yield _sse(_chunk(base_id, created, model, pi * body.n + comp.index, echoed, plp, None))
                n_completion += len(comp.token_ids)
                if key in held:
                    comp = held.pop(key).then(comp)
                if not comp.text and not comp.finish_reason:
                    held[key] = comp  # sent with the chunk that completes their text
                    continue
                lp = None
                if body.logprobs is not None and comp.token_ids:
                    lp = _completion_logprobs(tokenizer, comp, body.logprobs, sent_text[key])
                sent_text[key] += len(comp.text)
                yield _sse(_chunk(base_id, created, model, pi * body.n + comp.index, comp.text, lp,
                                  comp.finish_reason))
            if out.finished:
                n_prompt += len(out.prompt_token_ids)
                n_cached += out.num_cached_tokens
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({"id": base_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": usage(n_prompt, n_completion, n_cached)})
    except (ValueError, RuntimeError) as e:
        yield _stream_error(e)
    yield "data: [DONE]\n\n"


def _chunk(base_id, created, model, index, text, logprobs, finish_reason) -> dict:
    return {"id": base_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


# ---- chat completions ----------------------------------------------------------------------------------------
def _chat_logprobs(tokenizer, token_ids: list[int], entries, n_top: int) -> dict:
    content = []
    for tok_id, entry in zip(token_ids, entries):
        text = _token_text(tokenizer, tok_id)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:n_top]
        content.append({
            "token": text, "logprob": entry[tok_id].logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t_text := _token_text(tokenizer, t)), "logprob": lp.logprob,
                              "bytes": list(t_text.encode())} for t, lp in ranked],
        })
    return {"content": content}


async def create_chat_completion(engine: AsyncLLM, body: ChatCompletionRequest, raw: Request, settings,
                                 lora=None):
    eng = engine.engine
    if body.top_logprobs is not None and not body.logprobs:
        raise ValueError("top_logprobs needs logprobs=true")
    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools] if body.tools else None
    text = render_chat(eng, body.conversation(), settings, body.add_generation_prompt, tools,
                       body.chat_template_kwargs)
    prompt_ids = eng.tokenizer(text, add_special_tokens=False).input_ids
    max_tokens = body.max_completion_tokens or body.max_tokens
    n_top = body.top_logprobs or 0
    sp = body.sampling_params(max_tokens, n_top if body.logprobs else None)
    if sp.structured_outputs is not None:
        sp.structured_outputs.start_after_token_id = _reasoning_end_id(eng.tokenizer, settings, prompt_ids)
    tokenizer = eng.tokenizer
    parsers = [ChatOutputParser.for_request(body, settings, tokenizer) for _ in range(body.n)]
    rid = random_id("chatcmpl")
    created, model = now(), settings.served_model_name if lora is None else lora.lora_name
    gen = engine.generate(rid, prompt_ids, sp, stream=body.stream, cache_salt=body.cache_salt, lora_request=lora)
    if body.stream:
        return StreamingResponse(_stream_chat(body, gen, rid, created, model, tokenizer, n_top, parsers),
                                 media_type="text/event-stream")
    out = await _collect(gen, raw)
    if out is None:
        return JSONResponse({}, status_code=499)
    choices = []
    for comp in out.outputs:
        lp = _chat_logprobs(tokenizer, comp.token_ids, comp.logprobs, n_top) if body.logprobs else None
        message, finish_reason = parsers[comp.index].message(comp.text, comp.finish_reason)
        choices.append({"index": comp.index, "message": message, "logprobs": lp, "finish_reason": finish_reason,
                        "stop_reason": comp.stop_reason})
    n_completion = sum(len(c.token_ids) for c in out.outputs)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(out.prompt_token_ids), n_completion, out.num_cached_tokens)}


async def _stream_chat(body: ChatCompletionRequest, gen, rid, created, model, tokenizer, n_top,
                       parsers: list[ChatOutputParser]):
    def chunk(choices, **extra):
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": choices, **extra})

    n_completion = 0
    held: dict[int, CompletionOutput] = {}  # tokens whose text is not complete yet
    last = None
    try:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(body.n)])
        async for out in gen:  # deltas: only what is new
            last = out
            for comp in out.outputs:
                n_completion += len(comp.token_ids)
                if comp.index in held:
                    comp = held.pop(comp.index).then(comp)
                if not comp.text and not comp.finish_reason:
                    held[comp.index] = comp  # sent with the chunk that completes their text
                    continue
                lp = None
                if body.logprobs and comp.token_ids:
                    lp = _chat_logprobs(tokenizer, comp.token_ids, comp.logprobs or [], n_top)
                parser = parsers[comp.index]
                deltas = parser.deltas(comp.text) if comp.text else []
                finish_reason = comp.finish_reason
                if finish_reason is not None:
                    rest, finish_reason = parser.finish(finish_reason)
                    deltas += rest
                if not deltas:  # nothing to show yet (a parser holds it): the logprobs and finish still go
                    if lp is not None or finish_reason is not None:
                        yield chunk([{"index": comp.index, "delta": {}, "logprobs": lp,
                                      "finish_reason": finish_reason}])
                    continue
                for k, delta in enumerate(deltas):
                    last_one = k == len(deltas) - 1
                    yield chunk([{"index": comp.index, "delta": delta, "logprobs": lp if k == 0 else None,
                                  "finish_reason": finish_reason if last_one else None}])
        if body.stream_options and body.stream_options.include_usage and last is not None:
            yield chunk([], usage=usage(len(last.prompt_token_ids), n_completion, last.num_cached_tokens))
    except (ValueError, RuntimeError) as e:
        yield _stream_error(e)
    finally:
        await gen.aclose()
    yield "data: [DONE]\n\n"


# ---- embeddings ----------------------------------------------------------------------------------------------
async def create_embedding(embedder, body: EmbeddingRequest, settings):
    inputs = body.input
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("input must not be empty")
    if body.dimensions is not None and body.dimensions != embedder.dim:
        raise ValueError(f"dimensions must be {embedder.dim} for this model, got {body.dimensions}")
    vectors, n_tokens = await asyncio.get_running_loop().run_in_executor(None, embedder.embed, inputs)
    data = []
    for i, v in enumerate(vectors):
        if body.encoding_format == "base64":
            emb = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
        else:
            emb = v
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": settings.served_model_name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
