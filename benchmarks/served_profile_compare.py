"""Served steps of two engines, kernel by kernel, from their `/start_profile` traces.

Both servers write torch.profiler Chrome traces between `POST /start_profile` and
`POST /stop_profile` (kvserve with KVSERVE_TORCH_PROFILER_DIR, vLLM with
VLLM_TORCH_PROFILER_DIR; `benchmarks/serve_load.sh` with PROFILE_SECONDS takes one window of
each server's first run). This reads each directory's trace (the largest `*.json` or
`*.json.gz`), keeps the device kernels, counts the engine steps by the greedy sampler's argmax
(one a step in both engines) and prints, per step: device time by kind (`kvserve.bench.profile`'s
kinds), busy and idle time over the window, and the top kernels; then the two side by side.

    python benchmarks/served_profile_compare.py DIR_A DIR_B [--top 12]
"""
from __future__ import annotations

import argparse
import gzip
import json
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    a, b = summary(load_kernels(args.a)), summary(load_kernels(args.b))
    print("\n".join(report(f"A {args.a}", a, args.top) + report(f"B {args.b}", b, args.top) + side_by_side(a, b)))


if __name__ == "__main__":
    main()
