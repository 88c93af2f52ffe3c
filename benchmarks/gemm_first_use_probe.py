"""What a GEMM costs the host the first time its row count is used in a process.

An offline step trace's first scenario had eager steps whose launch took ~200 ms of host
time, in cuBLAS's `cuKernelSetAttribute` under the logits GEMM (py-spy, native frames):
cuBLAS picks a kernel per shape, and a kernel's first launch in a process loads it (CUDA's
lazy module loading), which waits while the device is busy (--busy-ms). The logits GEMM runs
eagerly after every forward, graph replays included, with one row per sampled request, so
every batch size a server meets for the first time would pay it.

This times, in a fresh process, each GEMM's first call and its second (host time to the end
of the call, device synchronised), for the logits GEMM ([M, hidden] x [hidden, vocab]) at
M = 1..--max-rows and a layer GEMM at large M, then prints the calls over --slow-ms and the
totals. Run it with CUDA_MODULE_LOADING=EAGER too: kernels then load with their library.

    python3 benchmarks/gemm_first_use_probe.py --hidden 4096 --vocab 49152 --max-rows 300
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from cuda_api_probe import cycles_per_ms   # this folder: the script's own


BUSY_CYCLES = 0   # --busy-ms: device sleep queued before each timed call (set in main)


def layer_shapes(a: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """(out, in) features of two Qwen3-8B-like layer GEMMs: QKV (8 KV heads of 128) and the down projection."""
    return {"qkv": (a.hidden + 2 * 1024, a.hidden), "down": (a.hidden, a.intermediate)}


def timed_ms(fn) -> float:
    """Host ms of `fn`: to the end of the call alone when the device is kept busy
    (a call that waits for the queue shows it), else to the end of its device work."""
    torch.cuda.synchronize()
    if BUSY_CYCLES:
        torch.cuda._sleep(BUSY_CYCLES)
    start = time.perf_counter()
    fn()
    if not BUSY_CYCLES:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def kernel_names(weight: torch.Tensor, rows: list[int]) -> list[tuple[int, int, str]]:
    """(first M, last M, kernel) runs: the GEMM kernel cuBLAS launches at each M, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    names = []
    for chunk in range(0, len(rows), 256):
        ms = rows[chunk:chunk + 256]
        xs = [torch.randn(m, weight.shape[1], dtype=weight.dtype, device=weight.device) for m in ms]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for x in xs:
                torch.nn.functional.linear(x, weight)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        names += kernels if len(kernels) == len(ms) else [f"? {len(kernels)} kernels for {len(ms)} calls"] * len(ms)
    runs = []
    for m, name in zip(rows, names):
        if runs and runs[-1][2] == name:
            runs[-1] = (runs[-1][0], m, name)
        else:
            runs.append((m, m, name))
    return runs


def first_and_second(weight: torch.Tensor, rows: int) -> tuple[float, float]:
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    return timed_ms(lambda: torch.nn.functional.linear(x, weight)), \
        timed_ms(lambda: torch.nn.functional.linear(x, weight))


def sweep(name: str, weight: torch.Tensor, rows: list[int], slow_ms: float) -> None:
    slow, first_total, second_total = [], 0.0, 0.0
    for m in rows:
        first, second = first_and_second(weight, m)
        first_total, second_total = first_total + first, second_total + second
        if first > slow_ms:
            slow.append(f"{m}: {first:.1f}")
    print(f"{name}: {len(rows)} row counts, first calls {first_total:.0f} ms in all, second calls "
          f"{second_total:.0f} ms; over {slow_ms} ms ({len(slow)}): {', '.join(slow)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--max-rows", type=int, default=300)
    p.add_argument("--slow-ms", type=float, default=5.0)
    p.add_argument("--busy-ms", type=float, default=0.0,
                   help="queue this much device sleep before each timed call: does a first call wait for it?")
    p.add_argument("--warm-check", type=int, nargs=2, metavar=("LO", "HI"),
                   help="instead: warm the layer GEMMs at 8k and 8k + 1 rows in [LO, HI], then look for stalls "
                        "at --samples other row counts there (use with --busy-ms)")
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--kernels", action="store_true",
                   help="instead: each GEMM's kernel at every M (profiler), as runs of M")
    a = p.parse_args()
    if a.warm_check and not 1 <= a.warm_check[0] <= a.warm_check[1]:
        p.error(f"--warm-check needs 1 <= LO <= HI, got {a.warm_check[0]} {a.warm_check[1]}")
    print(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(unset: lazy)')}")
    start = time.perf_counter()
    torch.zeros(1, device="cuda")
    print(f"context: {(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    if a.kernels:
        return list_kernels(a, dev, dt)
    if a.warm_check:
        return warm_check(a, dev, dt)
    global BUSY_CYCLES
    BUSY_CYCLES = int(a.busy_ms * cycles_per_ms())
    lm_head = torch.randn(a.vocab, a.hidden, dtype=dt, device=dev) * 0.02
    print(f"first GEMM of the process: {timed_ms(lambda: torch.nn.functional.linear(torch.randn(8, a.hidden, dtype=dt, device=dev), lm_head)):.1f} ms")
    sweep("logits [M, hidden] x [hidden, vocab]", lm_head, list(range(1, a.max_rows + 1)), a.slow_ms)
    down = torch.randn(a.hidden, a.intermediate, dtype=dt, device=dev) * 0.02
    sweep("down proj [M, intermediate] x [intermediate, hidden], M 1,000-8,192 step 97", down,
          list(range(1000, 8193, 97)), a.slow_ms)
    sweep("logits again, M 1..max-rows (all seen)", lm_head, list(range(1, a.max_rows + 1)), a.slow_ms)


def warm_rows(lo: int, hi: int) -> list[int]:
    """Row counts 8k and 8k + 1 in [lo, hi]: cuBLAS's kernel changes at multiples of 8 rows
    (`--kernels`: a multiple of 8 may take its own kernel; 8k + 1..8k + 7 share one)."""
    return [m for k in range(lo // 8, hi // 8 + 1) for m in (8 * k, 8 * k + 1) if lo <= m <= hi]


def warm_check(a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> None:
    """Warm each layer GEMM at `warm_rows` over the eager range with the device idle, then
    time first calls at random row counts of that range with the device busy: a kernel the
    warm-up missed shows as a stall."""
    import random
    global BUSY_CYCLES
    lo, hi = a.warm_check
    rng = random.Random(0)
    rows = warm_rows(lo, hi)
    others = sorted(set(range(lo, hi + 1)) - set(rows))
    for name, (out_f, in_f) in layer_shapes(a).items():
        weight = torch.randn(out_f, in_f, dtype=dt, device=dev) * 0.02
        BUSY_CYCLES = 0
        start = time.perf_counter()
        x = torch.randn(hi + 1, in_f, dtype=dt, device=dev)
        for m in rows:
            torch.nn.functional.linear(x[:m], weight)
        torch.cuda.synchronize()
        print(f"{name}: warmed {len(rows)} row counts in {(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)
        BUSY_CYCLES = int(a.busy_ms * cycles_per_ms())
        picks = rng.sample(others, min(a.samples, len(others)))
        sweep(f"{name} at {a.samples} other row counts in [{lo}, {hi}], device busy", weight, picks, a.slow_ms)


def list_kernels(a: argparse.Namespace, dev: torch.device, dt: torch.dtype) -> None:
    shapes = {"logits": (a.vocab, a.hidden, a.max_rows),
              **{name: (*shape, 8192) for name, shape in layer_shapes(a).items()}}
    for name, (out_f, in_f, max_m) in shapes.items():
        weight = torch.randn(out_f, in_f, dtype=dt, device=dev) * 0.02
        runs = kernel_names(weight, list(range(1, max_m + 1)))
        print(f"{name} [M, {in_f}] x [{in_f}, {out_f}], M 1..{max_m}: {len(runs)} runs, "
              f"{len({k for _, _, k in runs})} kernels", flush=True)
        for first, last, kernel in runs[:60]:
            print(f"  {first}-{last}: {kernel[:110]}")


if __name__ == "__main__":
    main()
