"""/v1/completions with use_beam_search (vLLM's field): core/beam_search.py's search, each step's one-token requests
sent to the engine together."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from vserve.core.async_engine import AsyncLLM
from vserve.core.beam_search import BeamSearchParams, advance_all, finish_searches, start_searches, step_params
from vserve.core.server.protocol import CompletionRequest, now, random_id, usage
from vserve.core.server.serving import _collect, _legacy_logprobs


async def create_beam_search_completion(engine: AsyncLLM, body: CompletionRequest, raw: Request, settings):
    """use_beam_search: the search of core/beam_search.py, each step's one-token requests sent together."""
    if body.stream:
        raise ValueError("use_beam_search cannot be used with stream")
    if body.max_tokens == 0:
        raise ValueError("use_beam_search needs max_tokens >= 1")
    width = body.best_of or body.n
    if width < body.n:
        raise ValueError(f"best_of must be >= n, got best_of={width}, n={body.n}")
    proc = engine.engine.processor
    params = BeamSearchParams(beam_width=width, max_tokens=body.max_tokens or proc.max_model_len,  # None: what fits
                              ignore_eos=body.ignore_eos, temperature=body.temperature or 0.0,
                              length_penalty=body.length_penalty, early_stopping=body.early_stopping,
                              structured_outputs=body.structured())
    prompts = body.prompts()
    searches = start_searches(proc, prompts, params)
    base_id = random_id("cmpl")
    step = 0
    while batch := [seq for s in searches for seq in s.pending()]:
        gens = [engine.generate(f"{base_id}-{step}-{k}", seq, p, stream=False)
                for k, (seq, p) in enumerate(zip(batch, step_params(searches)))]
        outs = await asyncio.gather(*[_collect(g, raw) for g in gens])
        if any(o is None for o in outs):
            return JSONResponse({}, status_code=499)
        advance_all(searches, outs)
        step += 1
    tokenizer = engine.engine.tokenizer
    choices, n_prompt, n_completion = [], 0, 0
    for pi, (search, result) in enumerate(zip(searches, finish_searches(proc, searches))):
        n_prompt += len(search.prompt)
        prefix = tokenizer.decode(search.prompt) if body.echo else ""
        for j, seq in enumerate(result.sequences[:body.n]):
            gen = seq.tokens[len(search.prompt):]
            n_completion += len(gen)
            shown = gen if seq.finish_reason != "stop" else gen[:-1]  # a stop token's text is not shown
            lp = None
            if body.logprobs is not None:
                lp = _legacy_logprobs(tokenizer, gen, seq.logprobs, body.logprobs, len(prefix))
            text = prefix + tokenizer.decode(shown, skip_special_tokens=True)
            choices.append({"index": pi * body.n + j, "text": text,
                            "logprobs": lp, "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason})
    return {"id": base_id, "object": "text_completion", "created": now(), "model": settings.served_model_name,
            "choices": choices, "usage": usage(n_prompt, n_completion)}
