"""The GPU's clock, temperature and power while a benchmark runs, for the windows it times.

Two engines' times compare only at the same clocks. An H200 boosts less when it is hot or near its
power limit, and what sets that differs between runs of the same code: which engine ran just
before, and the values the GEMMs multiply (`gemm_data_probe.py`). So each timed window gets the
GPU's state beside its seconds.

`nvidia-smi -lms` samples in a process of its own (no host work in the benchmark's process),
appending a line every `period_ms` to a file. `mark()` notes where a window starts in that file,
`summary(mark)` reads the lines written since and averages them. Without nvidia-smi (a CPU machine)
the log is off and every summary is empty.

    log = GpuStateLog.start()
    mark = log.mark(); ...timed work...; state = log.summary(mark)   # {"sm_mhz": ..., ...}
    log.stop()
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Sequence

# nvidia-smi's query fields, in this order, and each one's key in a summary
FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")
KEYS = ("sm_mhz", "mem_mhz", "temp_c", "power_w")


class GpuStateLog:
    """A sampler process appending to a log file; windows are byte offsets into the file."""

    def __init__(self, proc: subprocess.Popen | None, path: str | None) -> None:
        self._proc, self._path = proc, path

    @classmethod
    def start(cls, device: int = 0, period_ms: int = 250, command: Sequence[str] | None = None) -> "GpuStateLog":
        """Sampling starts (an empty log where there is no nvidia-smi). `command` replaces
        nvidia-smi (tests): it must print "sm, mem, temp, power" lines to stdout."""
        if command is None:
            if shutil.which("nvidia-smi") is None:
                return cls(None, None)
            command = ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                       "-lms", str(period_ms), "-i", str(device)]
        fd, path = tempfile.mkstemp(prefix="gpu_state_", suffix=".csv")
        with os.fdopen(fd, "w") as out:
            proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.DEVNULL)
        return cls(proc, path)

    @property
    def on(self) -> bool:
        return self._proc is not None

    def mark(self) -> int:
        """Where a window starts: the log's length now."""
        return os.path.getsize(self._path) if self.on else 0

    def summary(self, since: int) -> dict[str, float]:
        """Mean SM and memory clocks, the lowest SM clock, mean power and the highest
        temperature over the samples written since `since` ({} when there are none)."""
        if not self.on:
            return {}
        with open(self._path) as f:
            f.seek(max(since - 1, 0))
            text = f.read()
        if since > 0:   # a mark inside a line (the sampler was writing it): that line is the last window's
            text = text[text.index("\n") + 1:] if "\n" in text else ""
        rows = parse(text)
        if not rows:
            return {}
        cols = dict(zip(KEYS, zip(*rows)))
        return {"samples": len(rows), "sm_mhz": statistics.fmean(cols["sm_mhz"]), "sm_mhz_min": min(cols["sm_mhz"]),
                "mem_mhz": statistics.fmean(cols["mem_mhz"]), "power_w": statistics.fmean(cols["power_w"]),
                "temp_c_max": max(cols["temp_c"])}

    def stop(self) -> None:
        if not self.on:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        os.unlink(self._path)
        self._proc = self._path = None


def parse(text: str) -> list[tuple[float, ...]]:
    """Complete "sm, mem, temp, power" lines as floats; a line cut off at the end of the file
    (still being written) or holding "[N/A]" is left out."""
    rows = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            values = tuple(float(v) for v in line.split(","))
        except ValueError:
            continue
        if len(values) == len(FIELDS):
            rows.append(values)
    return rows

