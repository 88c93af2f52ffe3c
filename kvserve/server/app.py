"""The FastAPI application: routes, OpenAI-style error bodies, auth, CORS,
request ids, lifecycle, and a published OpenAPI schema that says what the
server does (400/401/404/500/503 with the error body; no 422; /health and
/metrics as text).

`build_app` takes a constructed LLMEngine; the AsyncEngine's thread starts
and stops with the app (lifespan), so tests and the CLI share one path.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.diagnose.endpoint import add_debug_routes
from kvserve.server.profiling import add_profile_routes
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     FieldError, TokenizeRequest)
from kvserve.server.serving import GenerationHandler

logger = logging.getLogger(__name__)
EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServerOptions:
    """HTTP-side options (the engine's are in EngineArgs)."""
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    generation_defaults: tuple[tuple[str, Any], ...] = ()
    enable_vllm_metrics: bool = False
    tool_call_parser: str = "hermes"   # how tool_choice="auto" reads calls (server/tools.py)


def default_model_names(model: str | None) -> list[str]:
    """The model path's basename, then the path as given (vLLM's default name):
    a client moving from vLLM may send either."""
    if model is None:
        return [EMBEDDED_SERVED_NAME]
    base = os.path.basename(os.path.normpath(model)) or model
    return [base] if base == model else [base, model]


def build_app(engine, served_model_name: str | Sequence[str], max_waiting_requests: int | None = None,
              options: ServerOptions | None = None, engine_hook=None) -> FastAPI:
    """`engine`: EngineArgs (the core runs in its own process) or a built LLMEngine
    (the core runs on a thread). `engine_hook(engine)` runs in the core once built.
    `served_model_name`: the name clients pass as `model`, or several (vLLM's
    `--served-model-name A B`): each is accepted and listed; responses carry the first."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    options = options or ServerOptions()
    async_engine = AsyncEngine(engine, None, max_waiting_requests, engine_hook)
    metrics = ServerMetrics(async_engine.cache_info, names[0], options.enable_vllm_metrics)
    async_engine.metrics = metrics
    handler = GenerationHandler(async_engine, names, dict(options.generation_defaults),
                                options.tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="kvserve", version=_version(), lifespan=lifespan)
    app.state.async_engine, app.state.metrics = async_engine, metrics
    _add_error_handlers(app)
    _add_routes(app, handler, metrics, names)
    add_debug_routes(app, async_engine)  # GET /debug/kvserve (kvserve diagnose --url)
    add_profile_routes(app, async_engine)  # POST /start_profile, /stop_profile (KVSERVE_TORCH_PROFILER_DIR)
    _add_middleware(app, options)
    vocab_size = async_engine.engine.model_config.vocab_size
    app.openapi = lambda: _openapi(app, vocab_size)
    return app


# -- routes ------------------------------------------------------------------------------
ERROR_BODY = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_ERRORS = {400: "Invalid request (the error's `param` names the field)", 401: "Missing or wrong API key",
           404: "Unknown model or path", 500: "The engine failed while running this request",
           503: "Overloaded: retry after Retry-After seconds"}


def _responses(*codes: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {c: {"description": _ERRORS[c], "content": ERROR_BODY} for c in codes}
    if stream:
        out[200] = {"description": "A response object, or server-sent events when stream is true",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return out


def _add_routes(app: FastAPI, handler: GenerationHandler, metrics: ServerMetrics, names: list[str]) -> None:
    created = int(time.time())
    generate = _responses(400, 401, 404, 500, 503, stream=True)

    @app.get("/health", response_class=PlainTextResponse,
             responses={200: {"description": "The engine can serve", "content": {"text/plain": {}}},
                        503: {"description": "The engine cannot serve", "content": {"text/plain": {}}}})
    async def health() -> Response:
        ok = handler.engine.is_healthy
        return PlainTextResponse("" if ok else "engine stopped", status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/v1/models", responses=_responses(401))
    async def models() -> dict:
        max_model_len = handler.engine.engine.scheduler_config.max_model_len
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "kvserve", "max_model_len": max_model_len}
                                           for name in names]}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", responses=generate)
    async def completions(body: CompletionRequest, request: Request):
        return await handler.completions(body, request)

    @app.post("/v1/chat/completions", responses=generate)
    async def chat(body: ChatCompletionRequest, request: Request):
        return await handler.chat(body, request)

    @app.post("/tokenize", responses=_responses(400, 404))
    async def tokenize(body: TokenizeRequest) -> dict:
        return handler.tokenize(body)

    @app.post("/detokenize", responses=_responses(400, 404))
    async def detokenize(body: DetokenizeRequest) -> dict:
        return handler.detokenize(body)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvserve")
    except PackageNotFoundError:
        return "0.0.0"


# -- middleware: request ids, API key, CORS ------------------------------------------------
def _add_middleware(app: FastAPI, options: ServerOptions) -> None:
    app.add_middleware(RequestIdAndAuth, api_key=options.api_key)
    if options.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"], expose_headers=["X-Request-Id"])


class RequestIdAndAuth:
    """Every HTTP response carries X-Request-Id (the client's, or a new one); /v1 routes
    need the API key when one is set.

    A plain ASGI middleware, not Starlette's `@app.middleware("http")`: that one passes
    every chunk of a streamed response through a memory stream and another task, which
    cost ~40 us a chunk against ~2 us (benchmarks/middleware_bench.py), paid once per
    token of every stream."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)
        if self.api_key is not None and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS" \
                and not _authorized(headers.get("authorization", ""), self.api_key):
            response = JSONResponse(APIError(
                401, "Incorrect API key provided: send it as `Authorization: Bearer <key>`.",
                code="invalid_api_key").body(), status_code=401)
            await response(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


def _authorized(header: str, api_key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), api_key)


# -- errors ------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400, not FastAPI's 422, and names the offending field.
        param, message = validation_message(e.errors())
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}",
                                     type="internal_server_error").body(), status_code=500)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str | None, str]:
    """(param, message) of pydantic's first error, without its "Value error, " prefix."""
    first = errors[0] if errors else {}
    cause = (first.get("ctx") or {}).get("error")
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not isinstance(p, int)]
    if isinstance(cause, FieldError):
        return cause.param, str(cause)
    param = loc[0] if loc else None
    if first.get("type") == "none_required" and param:
        return param, f"{param} is not supported by this server (only null is accepted)"
    if first.get("type") == "extra_forbidden" and param:
        return param, f"unknown field `{'.'.join(loc)}`: this server does not accept it"
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in ("missing", "model_attributes_type"):
        return None, "the request body must be a JSON object"
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return None, f"the body is not valid JSON: {message}"
    return param, f"{'.'.join(loc)}: {message}" if param else message


def _openapi(app: FastAPI, vocab_size: int) -> dict[str, Any]:
    """FastAPI's schema, corrected to what the server answers: validation errors
    are 400 with the OpenAI error body, never 422; token ids stop at the vocabulary."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    components["ErrorResponse"] = {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                                 "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                "param": {"type": ["string", "null"]},
                                                "code": {"type": ["string", "null"]}}}}}
    _bound_token_ids(schema, vocab_size - 1)
    app.openapi_schema = schema
    return schema


def _bound_token_ids(node: Any, max_id: int) -> None:
    if isinstance(node, dict):
        if node.pop("x-token-id", False):
            node["maximum"] = max_id
        for value in node.values():
            _bound_token_ids(value, max_id)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, max_id)
