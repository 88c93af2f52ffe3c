"""Host microseconds a CUDA API call costs on this machine, and whether host code runs
slower right after the thread waited for the device.

The engine's host parts on the H200's host read 1.3-1.8x the same parts with the forward
stubbed out on the same host's CPU (`host_step_bench.py --stub-forward`), and input
preparation 3x. Two causes would do that: CUDA API calls that cost tens of microseconds
each on this virtual machine, or host code that runs slower after the wait for the step
in flight (caches or clocks). This prints, per call, the median of many:

- each API call a decode step makes (stream lookup, event record / query / synchronize, a
  small pinned upload, a kernel launch, a graph replay, caching-allocator tensors);
- a fixed Python pass over 256 objects (the shape of the engine's per-request loops), hot,
  then right after the thread waited for ~15 ms of device work (a spin and a blocking wait).

    python benchmarks/cuda_api_probe.py            # CUDA
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
import torch

from kvserve.runner.staging import current_stream


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median microseconds of one call over `calls`, each timed alone."""
    for _ in range(32):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1e3


def api_calls(device: torch.device) -> dict[str, Callable[[], object]]:
    """One thunk per API call a decode step makes."""
    done, x = torch.cuda.Event(), torch.zeros(1024, device=device)
    done.record()
    torch.cuda.synchronize()
    pinned = torch.zeros(1024, dtype=torch.int32).pin_memory()
    target = torch.empty(1024, dtype=torch.int32, device=device)
    ids = torch.zeros(256, dtype=torch.long, device=device)
    host_ids = torch.empty(256, dtype=torch.long).pin_memory()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return {
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "staging.current_stream (raw handle)": lambda: current_stream(device),
        "Event() + record()": lambda: torch.cuda.Event().record(),
        "event.record() (reused event)": done.record,
        "event.query() (passed)": done.query,
        "event.synchronize() (passed)": done.synchronize,
        "4 KB pinned -> device copy_(non_blocking)": lambda: target.copy_(pinned, non_blocking=True),
        "256 ids device -> pinned host copy_": lambda: host_ids.copy_(ids, non_blocking=True),
        "kernel launch (x.add_(1), 1K floats)": lambda: x.add_(1),
        "graph replay (one kernel)": graph.replay,
        "torch.empty(1024) on the device": lambda: torch.empty(1024, device=device),
        "torch.empty(256 long, pin_memory)": lambda: torch.empty(256, dtype=torch.long, pin_memory=True),
        "numpy write of 256 int32 (host only)": lambda: np.copyto(pinned.numpy()[:256], 1),
    }


class Row:
    __slots__ = ("tokens", "start", "left")

    def __init__(self, i: int) -> None:
        self.tokens, self.start, self.left = list(range(i % 7 + 1)), i, 100 + i


def python_pass(rows: list[Row]) -> int:
    """A per-request loop like the engine's: attribute reads, an append, a test."""
    total = 0
    for row in rows:
        row.tokens.append(row.start)
        row.tokens.pop()
        if row.left > 0:
            total += row.start
    return total


def after_wait_us(rows: list[Row], wait: Callable[[], None], rounds: int) -> float:
    """Median us of `python_pass` right after `wait` returns."""
    samples = []
    for _ in range(rounds):
        wait()
        start = time.perf_counter_ns()
        python_pass(rows)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1e3


def cycles_per_ms() -> float:
    """`torch.cuda._sleep` cycles a millisecond, timed with events."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    stop.record()
    stop.synchronize()
    return 10_000_000 / start.elapsed_time(stop)


def device_wait(mode: str) -> Callable[[], None]:
    """Queue ~15 ms of device sleep, then wait for it: spinning on an event's query, or blocking."""
    cycles = int(15 * cycles_per_ms())

    def wait() -> None:
        torch.cuda._sleep(cycles)
        event = torch.cuda.Event(blocking=(mode == "blocking"))
        event.record()
        if mode == "spin":
            while not event.query():
                pass
        else:
            event.synchronize()
    return wait


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=60)
    a = p.parse_args()
    device = torch.device("cuda")
    print(f"{'call':>44} {'us (median)':>12}")
    for name, fn in api_calls(device).items():
        print(f"{name:>44} {per_call_us(fn, a.calls):12.2f}")
    torch.cuda.synchronize()
    rows = [Row(i) for i in range(256)]
    print(f"{'python pass over 256 objects':>44} {'us (median)':>12}")
    print(f"{'hot (back to back)':>44} {after_wait_us(rows, lambda: None, a.rounds * 10):12.2f}")
    print(f"{'after 15 ms idle (time.sleep)':>44} {after_wait_us(rows, lambda: time.sleep(0.015), a.rounds):12.2f}")
    for mode in ("spin", "blocking"):
        print(f"{'after a 15 ms device wait, ' + mode:>44} {after_wait_us(rows, device_wait(mode), a.rounds):12.2f}")


if __name__ == "__main__":
    main()
