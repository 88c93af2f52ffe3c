"""The lm_head product, [M, hidden] x [hidden, vocab], as the fastest of a few equal formulations,
chosen per number of rows by timing each once on the device.

cuBLAS picks one tile shape for the whole product from its heuristics. Cutting the head into
column blocks of at most `rows` vocabulary rows gives each block the tile shapes a smaller
projection gets (gate_up's 24,576 rows read at about 3.9 TB/s on an H200). Which formulation
wins depends on the shape, the library and the chip, so none is hard-coded: the runner times them
before serving (`LogitsPlan.tune`) and keeps the best per batch-size bucket; where one product is
fastest, it stays. Every formulation computes the same dot products; only the cuts differ.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Vocabulary rows per block (0: one product); the 24,576 of gate_up, then smaller.
CANDIDATE_ROWS = (0, 32768, 24576, 16384, 12288, 8192)
# Batch-size buckets: a step with M rows uses the plan of the smallest bucket >= M.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def blocked_linear(hidden: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """hidden @ weight.T, the weight taken in blocks of `rows` output rows (0: all at once)."""
    if rows <= 0 or rows >= weight.shape[0]:
        return F.linear(hidden, weight)
    return torch.cat([F.linear(hidden, part) for part in weight.split(rows)], dim=-1)


class LogitsPlan:
    """Rows per block for each batch-size bucket; sizes past the last bucket take one product."""

    def __init__(self, rows_by_bucket: dict[int, int] | None = None) -> None:
        self.rows_by_bucket = dict(sorted((rows_by_bucket or {}).items()))
        self._buckets = list(self.rows_by_bucket)
        self.timings_ms: dict[int, dict[int, float]] = {}

    def rows_for(self, num_rows: int) -> int:
        i = bisect.bisect_left(self._buckets, num_rows)
        return self.rows_by_bucket[self._buckets[i]] if i < len(self._buckets) else 0

    @classmethod
    def tune(cls, weight: torch.Tensor, max_rows: int, reps: int = 10) -> "LogitsPlan":
        """Time every candidate at each bucket up to `max_rows` (and the bucket holding it)."""
        buckets = [b for b in BUCKETS if b < max_rows] + [next((b for b in BUCKETS if b >= max_rows), BUCKETS[-1])]
        timings = {m: _time_candidates(weight, m, reps) for m in sorted(set(buckets))}
        plan = cls({m: min(t, key=t.get) for m, t in timings.items()})
        plan.timings_ms = timings
        return plan

    def describe(self) -> str:
        """One line per bucket: the chosen rows and its time against one product's."""
        return "; ".join(f"M<={m}: {'one product' if r == 0 else f'{r}-row blocks'} "
                         f"{self.timings_ms[m][r]:.3f} vs {self.timings_ms[m][0]:.3f} ms"
                         for m, r in self.rows_by_bucket.items() if m in self.timings_ms)


def _time_candidates(weight: torch.Tensor, num_rows: int, reps: int) -> dict[int, float]:
    hidden = torch.randn(num_rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    return {rows: _mean_ms(lambda: blocked_linear(hidden, weight, rows), reps, weight.device)
            for rows in CANDIDATE_ROWS if rows < weight.shape[0]}


def _mean_ms(fn: Callable[[], torch.Tensor], reps: int, device: torch.device) -> float:
    """Device ms per call over `reps` calls queued back to back (the host keeps ahead, so launch
    gaps do not count: in a served step the lm_head is launched while the forward runs)."""
    fn()  # warm-up: the library's first call picks and loads its kernel
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e3 / reps
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / reps
