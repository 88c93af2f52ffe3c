"""`GET /debug/kvserve`: what `kvserve diagnose --url` samples from a live
server: the engine's whole metrics snapshot (including what /metrics does not
export: reusable-prefix counters, arrivals), its configuration, and, when the
engine runs in the server's process, the recent finished requests' timelines.
Read-only: the snapshot is the one the engine publishes after each step.
"""
from __future__ import annotations

import time

from kvserve.diagnose.record import config_from_labels, engine_config


def add_debug_routes(app, metrics, async_engine) -> None:
    engine = async_engine.engine
    if hasattr(engine, "kv_cache"):  # an LLMEngine on a thread of this process
        config, recent = engine_config(engine), engine.recorder.recent_requests
    else:  # an engine core elsewhere: its published configuration only
        config, recent = config_from_labels(async_engine.cache_info), list

    @app.get("/debug/kvserve")
    async def debug_kvserve() -> dict:
        return {"t": time.monotonic(), "config": config, "metrics": dict(metrics.snapshot), "requests": recent()}
