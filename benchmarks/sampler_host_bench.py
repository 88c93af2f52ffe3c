"""Host microseconds of one `Sampler.sample` call over N rows of a tiny
vocabulary, the same requests step after step (steady decode): what the
sampler costs the host beyond its device ops, whose CPU compute a vocabulary
of 8 makes negligible. Best of `--reps` calls.

    python benchmarks/sampler_host_bench.py --rows 32,128,256
"""
from __future__ import annotations

import argparse
import time

import torch

from kvserve.runner.sampler import Sampler
from kvserve.sampling_params import SamplingParams


def best_us(rows: int, reps: int, temperature: float) -> float:
    params = [SamplingParams(temperature=temperature, max_tokens=100, ignore_eos=True) for _ in range(rows)]
    ids = [f"r{i}" for i in range(rows)]
    sampler, logits = Sampler(0, torch.device("cpu")), torch.zeros(rows, 8)
    best = float("inf")
    for _ in range(reps):
        request_ids = list(ids)   # the runner builds a new list every step
        start = time.perf_counter_ns()
        sampler.sample(logits, params, request_ids).resolve()
        best = min(best, time.perf_counter_ns() - start)
    return best / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="32,128,256")
    p.add_argument("--reps", type=int, default=300)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'rows':>8} {'greedy us':>10} {'temp 1.0 us':>12}")
    for rows in map(int, a.rows.split(",")):
        print(f"{rows:>8} {best_us(rows, a.reps, 0.0):>10.1f} {best_us(rows, a.reps, 1.0):>12.1f}")


if __name__ == "__main__":
    main()
