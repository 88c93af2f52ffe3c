"""Microseconds an upload through the staging ring (`kvserve/runner/staging.py`) takes on this
CPU, by how the step's row count moves: steady (256 rows every step), a random walk within
150-256 rows (a server's running set, requests finishing and arriving), and falling by one a
step from 256 with no count met twice (a fresh ring: requests finishing, none arriving).

The ring's "device" buffers are on the CPU here, so the copy is a memcpy, not a transfer: the
figures are the host's layout and write work. Eight decode-shaped parts, as a one-group decode
step uploads (ids, positions, logits rows, query starts, lengths, slots, a 80-column table, the
kept rows' index). `--staging FILE` times another version of the module, e.g. an earlier
commit's: `git show REV:kvserve/runner/staging.py > /tmp/staging_rev.py`.

Usage: python benchmarks/staging_layout_bench.py [--staging FILE] [--repeats 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class NoEvent:
    """The ring's copy event on a CPU "device": nothing to wait for."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def staging_module(path: str | None):
    """This tree's `kvserve.runner.staging`, or the module in file `path`."""
    if path is None:
        from kvserve.runner import staging
        return staging
    spec = importlib.util.spec_from_file_location("staging_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses and NamedTuples look their module up
    spec.loader.exec_module(module)
    return module


def decode_parts(rows: int, width: int = 80) -> list[torch.Tensor]:
    """A one-group decode step's upload of `rows` rows (the module doc's eight parts)."""
    i64, i32 = torch.int64, torch.int32
    return [torch.zeros(rows, dtype=i64), torch.zeros(rows, dtype=i64), torch.zeros(rows, dtype=i64),
            torch.zeros(rows + 1, dtype=i32), torch.zeros(rows, dtype=i32), torch.zeros(rows, dtype=i64),
            torch.zeros(rows, width, dtype=i32), torch.zeros(rows, dtype=i64)]


def median_upload_us(staging, counts: list[int]) -> float:
    """Median us of `StagingRing.upload` over steps of `counts` rows, a fresh ring, under
    inference mode (as the engine's steps run)."""
    ring, times = staging.StagingRing(torch.device("cpu"), pin_memory=False, event=NoEvent), []
    with torch.inference_mode():
        for rows in counts:
            parts = decode_parts(rows)
            start = time.perf_counter_ns()
            ring.upload(parts)
            times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def patterns() -> dict[str, list[int]]:
    """Each pattern's row count a step (the module doc's three)."""
    rng, rows, walk = random.Random(0), 200, []
    for _ in range(2000):
        rows = max(150, min(256, rows + rng.choice((-1, 0, 1))))
        walk.append(rows)
    return {"steady": [256] * 2000, "random walk 150-256": walk,
            "falling, none twice": list(range(256, 56, -1))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--staging", default=None, help="a staging.py to time instead of this tree's")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    staging = staging_module(a.staging)
    print(f"staging: {a.staging or 'this tree'}; median us an upload, {a.repeats} runs each")
    for name, counts in patterns().items():
        runs = [median_upload_us(staging, counts) for _ in range(a.repeats)]
        print(f"{name:22s} " + "  ".join(f"{us:6.1f}" for us in runs))


if __name__ == "__main__":
    main()
