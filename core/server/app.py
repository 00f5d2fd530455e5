"""The FastAPI app: routes, OpenAI error bodies, API-key guard, body limit, health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from vserve import __version__
from vserve.core.async_engine import AsyncLLM, EngineDeadError, QueueFullError
from vserve.core.server import serving
from vserve.core.server.metrics import EngineMetrics
from vserve.core.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    now,
)

log = logging.getLogger("vserve.server")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


@dataclass
class ServerSettings:
    served_model_name: str  # reported in responses
    served_model_aliases: tuple[str, ...] = ()  # further names clients may use (--served-model-name a b)
    api_key: str | None = None
    chat_template: str | None = None
    max_body_bytes: int = 8 << 20
    log_interval_s: float = 10.0
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parsed with tool_call_parser (core/tool_parsers.py)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # core/reasoning_parsers.py
    max_loras: int | None = None  # --max-loras when LoRA is on (metrics' lora_requests_info)
    lora_runtime_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist
    allow_special_tokens_in_content: bool = False  # else user/tool content's special-token strings are neutralised


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length or while streaming the body in."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await error_response(413, f"request body over {self.limit} bytes")(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise APIError(413, f"request body over {self.limit} bytes")
            return message

        return await self.app(scope, limited_receive, send)


def build_app(engine: AsyncLLM | None, settings: ServerSettings, metrics: EngineMetrics | None = None,
              embedder=None) -> FastAPI:
    """`engine` (an AsyncLLM) serves generation; `embedder` (an EmbeddingEngine) serves
    /v1/embeddings."""
    metrics = metrics or EngineMetrics(settings.served_model_name, settings.max_loras)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_log_loop())
        try:
            yield
        finally:
            task.cancel()
            if engine is not None:  # after uvicorn drained the requests; stops the engine process too
                engine.shutdown()

    async def _log_loop():
        while True:
            await asyncio.sleep(settings.log_interval_s)
            if engine is not None and engine.is_running:
                log.info(metrics.log_line(engine.engine))

    app = FastAPI(title="vserve", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.settings, app.state.metrics, app.state.embedder = engine, settings, metrics, embedder
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            msg = "unknown request field (OpenAI's API and vLLM's extras are accepted; docs/serving.md lists them)"
        return error_response(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ValueError)
    async def _value_error(_req, exc: ValueError):
        return error_response(400, str(exc))

    @app.exception_handler(QueueFullError)
    async def _queue_full(_req, exc: QueueFullError):
        return error_response(429, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_req, exc: EngineDeadError):
        return error_response(503, str(exc))

    async def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)")

    def check_model(name: str | None):
        """The LoRA adapter a request's `model` names (None: the base model)."""
        if name is None or name == settings.served_model_name or name in settings.served_model_aliases:
            return None
        lora = engine.loras.by_name.get(name) if engine is not None else None
        if lora is None:
            adapters = "".join(f", `{a}`" for a in engine.loras.by_name) if engine is not None else ""
            raise APIError(404, f"the model `{name}` does not exist; this server serves "
                                f"`{settings.served_model_name}`{adapters}", "model")
        return lora

    def need_engine():
        if engine is None:
            raise APIError(400, f"`{settings.served_model_name}` is an embedding model: use /v1/embeddings")
        return engine

    guarded = [Depends(check_key)]

    @app.get("/health")
    async def health():
        if engine is not None and not engine.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    @app.get("/prometheus_metrics")  # the seeds' path: the same exposition
    async def get_metrics():
        if engine is not None:
            metrics.refresh(engine.engine)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        max_len = engine.engine.max_model_len if engine is not None else embedder.max_model_len
        data = [{"id": name, "object": "model", "created": now(), "owned_by": "vserve", "root": None, "parent": None,
                 "max_model_len": max_len} for name in (settings.served_model_name, *settings.served_model_aliases)]
        if engine is not None:  # LoRA adapters, with the base model as parent (vLLM's model cards)
            data += [{"id": name, "object": "model", "created": now(), "owned_by": "vserve", "root": lr.lora_path,
                      "parent": settings.served_model_name, "max_model_len": max_len}
                     for name, lr in engine.loras.by_name.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, raw: Request):
        lora = check_model(body.model)
        return await serving.create_completion(need_engine(), body, raw, settings, lora)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        lora = check_model(body.model)
        return await serving.create_chat_completion(need_engine(), body, raw, settings, lora)

    @app.post("/v1/embeddings", dependencies=guarded)
    async def embeddings(body: EmbeddingRequest):
        check_model(body.model)
        if embedder is None:
            raise APIError(400, f"`{settings.served_model_name}` is not an embedding model")
        return await serving.create_embedding(embedder, body, settings)

    if engine is not None and settings.lora_runtime_updating:  # else these routes do not exist: 404
        @app.post("/v1/load_lora_adapter", dependencies=guarded)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            if body.lora_name in (settings.served_model_name, *settings.served_model_aliases):
                raise APIError(400, f"`{body.lora_name}` is the base model's name", "lora_name")
            engine.add_lora_adapter(body.lora_name, body.lora_path)  # ValueError (400) when bad: nothing added
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter", dependencies=guarded)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            if body.lora_name not in engine.loras.by_name:
                raise APIError(404, f"the LoRA adapter `{body.lora_name}` cannot be found", "lora_name")
            engine.remove_lora_adapter(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        eng = need_engine().engine
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages")
        if body.messages is not None:
            text = serving.render_chat(eng, [m.for_template() for m in body.messages], settings,
                                       body.add_generation_prompt)
            ids = eng.tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = eng.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return {"tokens": ids, "count": len(ids), "max_model_len": eng.max_model_len}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        eng = need_engine().engine
        vocab = eng.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary (size {vocab}): {bad[:5]}", "tokens")
        return {"prompt": eng.tokenizer.decode(body.tokens)}

    return app
