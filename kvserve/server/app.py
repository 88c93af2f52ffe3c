"""The FastAPI application: routes, OpenAI-style error bodies, lifecycle.

`build_app` takes a constructed LLMEngine; the AsyncEngine's thread starts
and stops with the app (lifespan), so tests and the CLI share one path.
"""
from __future__ import annotations

import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.server.async_engine import AsyncEngine
from kvserve.server.metrics import ServerMetrics, cache_info
from kvserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvserve.server.serving import GenerationHandler

EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"


def default_model_name(model: str | None) -> str:
    if model is None:
        return EMBEDDED_SERVED_NAME
    return os.path.basename(os.path.normpath(model)) or model


def build_app(engine, served_model_name: str, max_waiting_requests: int = 256) -> FastAPI:
    metrics = ServerMetrics(cache_info(engine), served_model_name)
    async_engine = AsyncEngine(engine, metrics, max_waiting_requests)
    handler = GenerationHandler(async_engine, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.async_engine, app.state.metrics = async_engine, metrics
    _add_error_handlers(app)
    _add_routes(app, handler, metrics, served_model_name)
    return app


def _add_routes(app: FastAPI, handler: GenerationHandler, metrics: ServerMetrics, name: str) -> None:
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        ok = handler.engine.is_healthy
        return Response(status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": name, "object": "model", "created": created, "owned_by": "kvserve",
                "max_model_len": handler.engine.engine.scheduler_config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await handler.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await handler.chat(body, request)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400, not FastAPI's 422, and names the offending field.
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not isinstance(p, int)]
        param = loc[0] if loc else None
        message = first.get("msg", "invalid request")
        if param:
            message = f"{'.'.join(loc)}: {message}"
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))
