"""Served steps of two engines, kernel by kernel, from their `/start_profile` traces.

Both servers write torch.profiler Chrome traces between `POST /start_profile` and
`POST /stop_profile` (kvserve with KVSERVE_TORCH_PROFILER_DIR, vLLM with
VLLM_TORCH_PROFILER_DIR; `benchmarks/serve_load.sh` with PROFILE_SECONDS takes one window of
each server's first run). This reads each directory's trace (the largest `*.json` or
`*.json.gz`), keeps the device kernels, counts the engine steps by the greedy sampler's argmax
(one a step in both engines) and prints, per step: device time by kind (`kvserve.bench.profile`'s
kinds), busy and idle time over the window, and the top kernels; then the two side by side.

    python benchmarks/served_profile_compare.py DIR_A DIR_B [--top 12]
    python benchmarks/served_profile_compare.py DIR --by-step [--top 8]

`--by-step` reads one kvserve trace: its steps split into mixed (a `_prefill` kernel
among them) and decode, each kind's span, busy time and kernels per step (medians), its
largest idle gap inside a step, and the top kernels' us a step; then the `--top` mixed steps
with the least prefill attention (the shortest chunks), kernel by kernel.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

from kvserve.bench.profile import kernel_kind

STEP_KERNEL = "ArgMaxOps"      # torch.argmax's reduce kernel: the greedy sampler's, once a step


def load_kernels(directory: str) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every device kernel (and memset/memcpy) in the trace."""
    files = sorted((p for p in Path(directory).rglob("*") if p.name.endswith((".json", ".json.gz"))),
                   key=lambda p: p.stat().st_size)
    if not files:
        raise SystemExit(f"{directory}: no trace (*.json or *.json.gz)")
    opener = gzip.open if files[-1].name.endswith(".gz") else open
    with opener(files[-1], "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e["ts"], e.get("dur", 0.0), e["name"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    if not kernels:
        raise SystemExit(f"{files[-1]}: no device kernels (a CPU-only trace?)")
    return kernels


def summary(kernels: list[tuple[float, float, str]]) -> dict:
    steps = max(1, sum(STEP_KERNEL in name for _, _, name in kernels))
    window = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
    by_kind, by_name = defaultdict(float), defaultdict(float)
    for _, dur, name in kernels:
        by_kind[kernel_kind(name)] += dur
        by_name[name] += dur
    return {"steps": steps, "window": window, "busy": _busy(kernels), "by_kind": by_kind, "by_name": by_name}


def _busy(kernels: list[tuple[float, float, str]]) -> float:
    """Time with at least one kernel running (overlapping kernels counted once)."""
    busy, end = 0.0, float("-inf")
    for start, dur, _ in kernels:
        busy += max(0.0, start + dur - max(start, end))
        end = max(end, start + dur)
    return busy


def report(label: str, s: dict, top: int) -> list[str]:
    per = lambda us: us / s["steps"] / 1e3  # noqa: E731 - ms a step
    lines = [f"{label}: {s['steps']} steps, {per(s['window']):.3f} ms a step over the window, "
             f"device busy {per(s['busy']):.3f}, idle {per(s['window'] - s['busy']):.3f}"]
    lines += [f"  {kind:<12} {per(us):8.3f} ms/step" for kind, us in sorted(s["by_kind"].items(), key=lambda kv: -kv[1])]
    lines += [f"    {per(us):8.3f} ms/step  {name[:90]}" for name, us in
              sorted(s["by_name"].items(), key=lambda kv: -kv[1])[:top]]
    return lines


def side_by_side(a: dict, b: dict) -> list[str]:
    kinds = sorted(set(a["by_kind"]) | set(b["by_kind"]))
    rows = ["| ms a step | A | B | A - B |", "|---|---:|---:|---:|"]
    for label, x, y in ([("window", a["window"], b["window"]), ("device busy", a["busy"], b["busy"])]
                        + [(k, a["by_kind"].get(k, 0.0), b["by_kind"].get(k, 0.0)) for k in kinds]):
        xa, yb = x / a["steps"] / 1e3, y / b["steps"] / 1e3
        rows.append(f"| {label} | {xa:.3f} | {yb:.3f} | {xa - yb:+.3f} |")
    return rows


PREFILL_KERNEL = "_prefill"   # kvserve's varlen attention (and its reduce): only in steps with a prompt chunk


def steps_of(kernels: list[tuple[float, float, str]]) -> list[list[tuple[float, float, str]]]:
    """The kernels cut into engine steps, each ending at its sampler's argmax (the window's
    first step, cut into by the window's start, dropped)."""
    steps, current = [], []
    for kernel in kernels:
        current.append(kernel)
        if STEP_KERNEL in kernel[2]:
            steps.append(current)
            current = []
    return steps[1:]


def largest_gap(step: list[tuple[float, float, str]]) -> float:
    """The longest time inside a step with no kernel running."""
    gap, end = 0.0, step[0][0]
    for start, dur, _ in step:
        gap, end = max(gap, start - end), max(end, start + dur)
    return gap


def by_step(kernels: list[tuple[float, float, str]], top: int) -> list[str]:
    """`--by-step`'s lines (module doc): each kind's medians and top kernels, then the `top`
    mixed steps with the least prefill attention, kernel by kernel."""
    kinds: dict[str, list] = {"mixed": [], "decode": []}
    for step in steps_of(kernels):
        kinds["mixed" if any(PREFILL_KERNEL in n for _, _, n in step) else "decode"].append(step)
    lines = []
    for kind, steps in kinds.items():
        if not steps:
            continue
        med = lambda f: statistics.median(map(f, steps))  # noqa: E731
        lines.append(f"{kind}: {len(steps)} steps, span {med(lambda s: s[-1][0] + s[-1][1] - s[0][0]):.0f} us, "
                     f"busy {med(_busy):.0f}, kernels {med(len):.0f}, largest idle gap {med(largest_gap):.0f} "
                     f"(medians a step; the longest gap of all: {max(map(largest_gap, steps)):.0f} us)")
        lines += [f"    {us:8.1f} us/step  {name[:80]}" for name, us in _per_step(steps)[:top]]
    shortest = sorted(kinds["mixed"], key=lambda s: sum(d for _, d, n in s if PREFILL_KERNEL in n))[:top]
    lines.append(f"the {len(shortest)} mixed steps with the least prefill attention (us):")
    lines += ["  " + ", ".join(f"{name[:28]} {us:.0f}" for name, us in _per_step([s])[:8]) for s in shortest]
    return lines


def _per_step(steps: list[list[tuple[float, float, str]]]) -> list[tuple[str, float]]:
    """(kernel name, us a step) over `steps`, largest first."""
    total: dict[str, float] = defaultdict(float)
    for step in steps:
        for _, dur, name in step:
            total[name] += dur
    return sorted(((n, us / len(steps)) for n, us in total.items()), key=lambda kv: -kv[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b", nargs="?")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--by-step", action="store_true", help="one trace's mixed and decode steps apart")
    args = p.parse_args()
    if args.by_step or args.b is None:
        print("\n".join(by_step(load_kernels(args.a), args.top)))
        return
    a, b = summary(load_kernels(args.a)), summary(load_kernels(args.b))
    print("\n".join(report(f"A {args.a}", a, args.top) + report(f"B {args.b}", b, args.top) + side_by_side(a, b)))


if __name__ == "__main__":
    main()
