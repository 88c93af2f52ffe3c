"""`POST /start_profile` and `POST /stop_profile`: the engine core under torch.profiler
(kvserve/engine/device_profile.py), routes that exist only when KVSERVE_TORCH_PROFILER_DIR
is set, as vLLM's do with VLLM_TORCH_PROFILER_DIR."""
from __future__ import annotations

import asyncio
from typing import Any

from kvserve.engine.device_profile import profiler_dir

# Stopping writes the trace before the core answers: a long profile's export takes seconds.
PROFILE_TIMEOUT_S = 300.0


def add_profile_routes(app, async_engine) -> None:
    if profiler_dir() is None:
        return
    from kvserve.server.protocol import APIError
    errors = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    responses = {400: {"description": "Already started (start) or not started (stop)", **errors},
                 503: {"description": "The engine core is not running or did not answer", **errors}}

    async def command(action: str) -> dict[str, Any]:
        if not async_engine.is_healthy:
            raise APIError(503, f"the engine is not running: {async_engine.error}", type="internal_server_error")
        try:
            reply = await async_engine.core.profile(action, PROFILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine core did not answer within {PROFILE_TIMEOUT_S:.0f} s",
                           type="internal_server_error") from None
        except RuntimeError as e:   # the core stopped while the command waited
            raise APIError(503, f"the engine is not running: {e}", type="internal_server_error") from None
        if "error" in reply:
            raise APIError(400, reply["error"])
        return reply

    @app.post("/start_profile", responses=responses)
    async def start_profile() -> dict:
        return await command("start")

    @app.post("/stop_profile", responses=responses)
    async def stop_profile() -> dict:
        return await command("stop")
