"""The served mixed burst's prefill under each attention policy of large eager steps, in one process.

The `mixed` workload's first 229 prompts (what the served run at 60 req/s sent in its first five
seconds), one token each, through kvserve's offline `LLM` in ~8K-token steps, once per policy
and round (the prefix cache emptied before each, so every run computes the same tokens):

- `paged`: every prompt row through the paged kernel (the TMA path off);
- `tma-longest`: the TMA path for a step whose longest chunk has 2,048+ tokens, all its chunks
  in the TMA kernel (the rule until the split);
- `tma-all`: the TMA path for every large step, whatever its chunks;
- `split`: as `tma-longest`, but the step's chunks under 2,048 tokens in the paged kernel
  (`TMA_SHORT_CHUNKS_PAGED_BELOW`; off by default until measured).

Per run: the wall time (the device sets it: ~8K-token eager steps) and, under torch's profiler
after the rounds, the attention kernels' device time. Rounds alternate the policies' order. The
engine runs without CUDA graphs (`enforce_eager`): the policies only touch steps past the
largest mixed graph, and the start-up skips the captures.

    python3 benchmarks/burst_attention_ab.py --model-dir .dummy-qwen3-8b [--rounds 2]
    # --rounds 0: only the profiled attention time of each policy
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_scenarios import ENGINE_ARGS, scenario_requests  # noqa: E402

from kvserve.attention.kernels import mixed  # noqa: E402
from kvserve.bench.profile import kernel_kind, kernel_rows, profiled_run  # noqa: E402

BURST, SERVED = 229, 256
POLICIES = {  # (the TMA path's longest-chunk gate, TMA_SHORT_CHUNKS_PAGED_BELOW), kernels/mixed.py
    "paged": (1 << 30, 0),
    "tma-longest": (2048, 0),
    "tma-all": (0, 0),
    "split": (2048, 2048),
}


def set_policy(name: str) -> None:
    longest, mixed.TMA_SHORT_CHUNKS_PAGED_BELOW = POLICIES[name]
    mixed.TMA_MIN_LONGEST_CHUNK = mixed.GLUON_MIN_LONGEST_CHUNK = longest


def timed(llm, prompts, params) -> float:
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def attention_ms(llm, prompts, params) -> float:
    llm.reset_prefix_cache()
    prof, _ = profiled_run(llm, prompts, params)
    return sum(r["us"] for r in kernel_rows(prof, on_gpu=True) if kernel_kind(r["name"]) == "attention") / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    if a.rounds < 0:
        p.error(f"--rounds must be >= 0, got {a.rounds}")
    from kvserve import LLM, SamplingParams
    llm = LLM(a.model_dir, load_format="dummy", dtype="bfloat16", enforce_eager=True, **ENGINE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    burst = [r.prompt for r in scenario_requests("mixed", SERVED, a.model_dir)[:BURST]]
    names = list(POLICIES)
    for name in names:   # warm: each policy's kernels compiled and its shapes seen once
        set_policy(name)
        timed(llm, burst[:40], params)
    walls: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            set_policy(name)
            walls[name].append(timed(llm, burst, params))
    print(f"burst prefill: {BURST} prompts, {sum(map(len, burst)):,} tokens, {a.rounds} rounds")
    print(f"{'policy':>12} {'wall s (each round)':>28} {'median':>8} {'attention ms (profiled)':>24}")
    for name in names:
        set_policy(name)
        attn = attention_ms(llm, burst, params)
        rounds = " ".join(f"{w:.3f}" for w in walls[name])
        median = statistics.median(walls[name]) if walls[name] else float("nan")
        print(f"{name:>12} {rounds:>28} {median:8.3f} {attn:24.1f}")


if __name__ == "__main__":
    main()
