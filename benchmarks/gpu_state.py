"""The GPU's clock, temperature and power while a benchmark runs, for the windows it times.

Two engines' times compare only at the same clocks. An H200 boosts less when it is hot or near its
power limit, and what sets that differs between runs of the same code: which engine ran just
before, and the values the GEMMs multiply (`gemm_data_probe.py`). So each timed window gets the
GPU's state beside its seconds.

`nvidia-smi -lms` samples in a process of its own (no host work in the benchmark's process),
appending a line every `period_ms` to a file. `mark()` notes where a window starts in that file,
`summary(mark)` reads the lines written since and averages them. Without nvidia-smi (a CPU machine)
the log is off and every summary is empty.

Where the driver reports why the clocks are held back (`clocks_event_reasons.active`, named
`clocks_throttle_reasons.active` by older drivers; probed once at start), each summary also gives
the share of samples held back by the power cap, by heat and by the hardware's slowdown: a lower
clock at the same mean power then says which limit set it.

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
# The optional fifth field, a bitmask (NVML's clocks event reasons), by its name in newer drivers first
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
# A summary's share of samples (%) with any of these reasons' bits set
REASONS = {"power_capped_pct": 0x4 | 0x80,      # software power cap, hardware power brake
           "thermal_pct": 0x20 | 0x40,          # software and hardware thermal slowdown
           "hw_slowdown_pct": 0x8}


class GpuStateLog:
    """A sampler process appending to a log file; windows are byte offsets into the file."""

    def __init__(self, proc: subprocess.Popen | None, path: str | None) -> None:
        self._proc, self._path = proc, path

    @classmethod
    def start(cls, device: int = 0, period_ms: int = 250, command: Sequence[str] | None = None) -> "GpuStateLog":
        """Sampling starts (an empty log where there is no nvidia-smi). `command` replaces
        nvidia-smi (tests): it must print "sm, mem, temp, power[, reasons]" lines to stdout."""
        if command is None:
            if shutil.which("nvidia-smi") is None:
                return cls(None, None)
            fields = FIELDS + tuple(filter(None, [reason_field(device)]))
            command = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
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
        temperature over the samples written since `since`, with the shares of `REASONS` where
        the log has the reasons ({} when there are no samples)."""
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
        cols = dict(zip(KEYS + ("reasons",), zip(*rows)))
        state = {"samples": len(rows), "sm_mhz": statistics.fmean(cols["sm_mhz"]), "sm_mhz_min": min(cols["sm_mhz"]),
                 "mem_mhz": statistics.fmean(cols["mem_mhz"]), "power_w": statistics.fmean(cols["power_w"]),
                 "temp_c_max": max(cols["temp_c"])}
        if "reasons" in cols:
            state.update({key: 100 * sum(int(r) & bits != 0 for r in cols["reasons"]) / len(rows)
                          for key, bits in REASONS.items()})
        return state

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


def reason_field(device: int = 0) -> str | None:
    """The first of `REASON_FIELDS` this driver answers with a bitmask (None: neither; an
    unknown field would make nvidia-smi print no samples at all)."""
    for field in REASON_FIELDS:
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader", "-i", str(device)],
                                 capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0 and out.stdout.strip().startswith("0x"):
            return field
    return None


def parse(text: str) -> list[tuple[float, ...]]:
    """Complete "sm, mem, temp, power[, reasons]" lines as numbers (reasons: a hex bitmask); a
    line cut off at the end of the file (still being written) or holding "[N/A]" is left out."""
    rows = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        cells = line.split(",")
        try:
            values = tuple(float(v) for v in cells[:len(FIELDS)]) + tuple(int(v, 16) for v in cells[len(FIELDS):])
        except ValueError:
            continue
        if len(values) in (len(FIELDS), len(FIELDS) + 1):
            rows.append(values)
    return rows

