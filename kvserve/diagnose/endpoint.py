"""`GET /debug/kvserve`: what `kvserve diagnose --url` samples from a live
server, and the engine-side snapshot behind it.

The snapshot is built where the engine lives (the engine core, in its own
process or on a thread) only when the route is called, and crosses the core
IPC as one reply (kvserve/engine/core_protocol.py, `CoreInputs.debug`): the
engine's configuration, its whole metrics snapshot taken now (including what
/metrics does not export: reusable-prefix counters, arrivals), the KV blocks
each cache group holds, and the last finished requests (`RequestRecorder`,
oldest first) as rows; the route turns the rows into timelines here, so the
core pauses between two steps only to copy references.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from kvserve.diagnose.record import engine_config
from kvserve.diagnose.recorder import request_records

# How long the route waits for the core's answer (it comes before the core's
# next step, so only a step that long, or a dead core, makes it wait).
SNAPSHOT_TIMEOUT_S = 10.0


def engine_snapshot(engine) -> dict[str, Any]:
    """The route's body, from an LLMEngine (called in the core, between steps)."""
    metrics = engine.get_metrics()
    config = engine_config(engine)
    return {"t": time.monotonic(), "config": config, "metrics": metrics,
            "kv_groups": kv_groups(metrics, config["num_blocks"]),
            "requests": engine.recorder.recent_rows()}


def kv_groups(metrics: dict[str, Any], num_blocks: int) -> list[dict[str, Any]]:
    """Per cache group: its attention spec, blocks held and share of the pool
    (block 0 is the NULL block, never handed out)."""
    out = []
    for key, blocks in metrics.get("kv_cache_group_blocks", {}).items():
        group, spec = key.split(":", 1)
        out.append({"group": int(group.removeprefix("g")), "spec": spec, "blocks_held": blocks,
                    "share_of_pool": blocks / max(num_blocks - 1, 1)})
    return out


def add_debug_routes(app, async_engine) -> None:
    from kvserve.server.protocol import APIError

    unavailable = {"description": "The engine core is not running or did not answer",
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}

    @app.get("/debug/kvserve", responses={503: unavailable})
    async def debug_kvserve() -> dict:
        if not async_engine.is_healthy:
            raise APIError(503, f"the engine is not running: {async_engine.error}", type="internal_server_error")
        try:
            snapshot = await async_engine.core.debug_snapshot(SNAPSHOT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine core did not answer within {SNAPSHOT_TIMEOUT_S:.0f} s",
                           type="internal_server_error") from None
        except RuntimeError as e:   # the core stopped while the query waited
            raise APIError(503, f"the engine is not running: {e}", type="internal_server_error") from None
        return {**snapshot, "requests": request_records(snapshot["requests"])}
