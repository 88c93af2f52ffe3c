"""A served engine core profiled on request: what its device ran, step by step.

`KVSERVE_TORCH_PROFILER_DIR=DIR kvserve serve ...` adds `POST /start_profile` and
`POST /stop_profile` (vLLM's routes and its `VLLM_TORCH_PROFILER_DIR` convention, so one
client profiles both engines under the same load). Between the two, torch.profiler records
the core's host ops and device kernels; stop writes into DIR a Chrome trace (Perfetto or
chrome://tracing) and a table of the ops by device time (host time without a GPU), and
answers with their paths and the number of engine steps recorded. The profiler's cost
lands on the profiled steps only.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV = "KVSERVE_TORCH_PROFILER_DIR"
TABLE_ROWS = 60


def profiler_dir() -> str | None:
    """The directory profiles go to, or None: profiling is off (the routes do not exist)."""
    return os.environ.get(ENV) or None


class CoreProfiler:
    """One torch.profiler session at a time, started and stopped by the API side's commands."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self._session: torch.profiler.profile | None = None
        self._first_step = 0

    def command(self, action: str, num_steps: int) -> dict[str, Any]:
        """`action` "start" or "stop" at the core's step count `num_steps`: the reply's
        fields, or {"error": ...} for a command that does not fit the state."""
        if action == "start":
            return self._start(num_steps)
        if action == "stop":
            return self._stop(num_steps)
        return {"error": f"unknown profiler action {action!r} (expected 'start' or 'stop')"}

    def close(self, num_steps: int) -> None:
        """At the core's exit: a session still running is written out, not lost (nor allowed
        to hide the exit's own error)."""
        if self._session is not None:
            try:
                self._stop(num_steps)
            except Exception:  # noqa: BLE001 - logged; the core is exiting either way
                logger.exception("writing the running profile at exit failed")

    def _start(self, num_steps: int) -> dict[str, Any]:
        if self._session is not None:
            return {"error": "a profile is already running: POST /stop_profile first"}
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._session = torch.profiler.profile(activities=activities)
        self._session.start()
        self._first_step = num_steps
        return {"status": "started", "directory": str(self.directory)}

    def _stop(self, num_steps: int) -> dict[str, Any]:
        if self._session is None:
            return {"error": "no profile is running: POST /start_profile first"}
        session, self._session = self._session, None
        session.stop()
        stem = self.directory / f"kvserve-core-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        trace, table = stem.with_suffix(".trace.json"), stem.with_suffix(".ops.txt")
        session.export_chrome_trace(str(trace))
        table.write_text(_ops_table(session))
        return {"status": "stopped", "steps": num_steps - self._first_step, "trace": str(trace),
                "table": str(table)}


def _ops_table(session: torch.profiler.profile) -> str:
    """The recorded ops by self device time (by self host time without a GPU)."""
    sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return session.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n"
