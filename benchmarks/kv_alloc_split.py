"""Where the KV cache manager's share of a decode step goes, with N requests
all decoding (the setting of `host_step_bench.py`): allocations that only move
a request's end inside its tail block (the fast path) against the ones that
cross into a new block (the direct path, `_open_next_block`, and the general
path's parts where it does not apply). Each part is timed in
place by a perf_counter wrapper over `--steps` steps after the warm-up (each
wrapper adds ~0.3 us a call, and the outer rows include their inner rows'
wrappers: read the rows against each other, not as a sum). Block size 16
means about N/16 crossings a step.

    python benchmarks/kv_alloc_split.py --running 256
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import host_step_bench as hb

# The direct path of the token that opens a block, then the general path's parts (an older
# tree without a part skips it, so the same command compares commits).
PARTS = ("_open_next_block", "_can_allocate", "_apply_allocation", "_cache_full_blocks", "_set_room")


class PartTimer:
    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: Any, name: str, label: str | None = None) -> None:
        fn, label = getattr(obj, name), label or name

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[label] += time.perf_counter_ns() - start
                self.calls[label] += 1
        setattr(obj, name, timed)


def split(engine, steps: int) -> PartTimer:
    kv, timer = engine.kv_cache, PartTimer()
    timer.wrap(kv, "_move_within_tail", "fast path (_move_within_tail)")
    timer.wrap(kv, "allocate_slots", "allocate_slots (all)")
    for name in PARTS:
        if hasattr(kv, name):
            timer.wrap(kv, name)
    timer.wrap(kv._held, "add_new", "  _apply_allocation: add_new")
    for manager in kv.managers:
        timer.wrap(manager, "allocate_new_blocks", "  _apply_allocation: allocate_new_blocks")
        timer.wrap(manager, "cache_full_blocks", "  _cache_full_blocks: cache_full_blocks")
    for _ in range(steps):
        engine.step()
    return timer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--steps", type=int, default=48)
    a = p.parse_args()
    # host_step_bench's setting: its defaults, stub forward, this many steps.
    args = hb.parse_args(["--running", str(a.running), "--steps", str(a.steps), "--stub-forward"])
    engine = hb.build_engine(args, a.running)
    hb.stub_forward(engine)
    hb.add_requests(engine, a.running, args)
    while not hb.all_decoding(engine, a.running):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    timer = split(engine, a.steps)
    print(f"{a.running} running, {a.steps} steps: per step")
    print(f"{'part':44s} {'calls':>7s} {'us each':>8s} {'us':>8s}")
    for label in timer.ns:
        calls = timer.calls[label]
        print(f"{label:44s} {calls / a.steps:7.1f} {timer.ns[label] / calls / 1e3:8.2f} "
              f"{timer.ns[label] / a.steps / 1e3:8.1f}")


if __name__ == "__main__":
    main()
