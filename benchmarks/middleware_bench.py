"""Microseconds per streamed chunk through the server's request-id middleware.

A FastAPI app streams N server-sent-event chunks to an in-process ASGI caller (no
socket), three ways: no middleware; the request-id header set by Starlette's
`@app.middleware("http")` (BaseHTTPMiddleware, what the server used before
1dce138); and the server's `RequestIdAndAuth` (plain ASGI). A stream sends one
chunk per token, so this is paid per token of every request.

    python benchmarks/middleware_bench.py [N]
"""
from __future__ import annotations

import asyncio
import sys
import time
import uuid

from fastapi import FastAPI, Request
from starlette.responses import StreamingResponse

from kvserve.server.app import RequestIdAndAuth


def make_app(kind: str, chunks: int) -> FastAPI:
    app = FastAPI()

    @app.get("/stream")
    async def stream():
        async def events():
            for i in range(chunks):
                yield f'data: {{"i":{i},"text":"hello"}}\n\n'
        return StreamingResponse(events(), media_type="text/event-stream")
    if kind == "base_http":
        @app.middleware("http")
        async def request_id(request: Request, call_next):
            rid = request.headers.get("x-request-id") or uuid.uuid4().hex
            response = await call_next(request)
            response.headers["X-Request-Id"] = rid
            return response
    elif kind == "asgi":
        app.add_middleware(RequestIdAndAuth, api_key=None)
    return app


async def us_per_chunk(app: FastAPI, chunks: int) -> float:
    seen = 0

    async def receive():
        await asyncio.sleep(3600)   # the client never disconnects
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal seen
        seen += message["type"] == "http.response.body"
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": "/stream", "raw_path": b"/stream", "query_string": b"", "headers": [],
             "server": ("bench", 80), "client": ("bench", 1), "root_path": "", "app": app}
    start = time.perf_counter()
    await app(scope, receive, send)
    assert seen >= chunks, seen
    return (time.perf_counter() - start) / chunks * 1e6


async def main(chunks: int) -> None:
    apps = {kind: make_app(kind, chunks) for kind in ("none", "base_http", "asgi")}
    times: dict[str, list[float]] = {kind: [] for kind in apps}
    for _ in range(3):   # interleaved repeats
        for kind, app in apps.items():
            times[kind].append(await us_per_chunk(app, chunks))
    for kind, values in times.items():
        print(f"{kind:10s} {min(values):7.2f} us/chunk (best of 3; all: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    if count < 1:
        sys.exit(f"N (chunks a stream) must be at least 1, got {count}")
    asyncio.run(main(count))
