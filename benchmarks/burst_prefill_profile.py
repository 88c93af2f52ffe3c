"""The served mixed burst's prefill, profiled the same way in either engine.

At 60 req/s the `mixed` workload's first 229 requests (218K prompt tokens) arrive in five
seconds, and both servers work through them in ~8K-token steps; kvserve's steps took ~1.08x
vLLM's (docs/BENCHMARKS.md, the serving record). This runs those prompts offline, one token
each (`max_tokens=1`: the work is their prefill, in the same steps a server runs), under
torch's profiler, and prints the device time by kernel kind and the top kernels over the
whole burst, and where the device sat idle. Both engines get the same prompt ids in the same
order, after the same warm-up (other prompts: the prefix cache starts cold for the burst), so
the two reports compare kernel by kernel.

    python3 benchmarks/burst_prefill_profile.py --engine kvserve --model-dir .dummy-qwen3-8b
    PYTHONPATH=$PWD:$PWD/.vsite python3 benchmarks/burst_prefill_profile.py --engine vllm --model-dir .dummy-qwen3-8b
    # --requests N: the burst's first N requests (default 229). Without CUDA it reports CPU ops.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_scenarios import dummy_llm, scenario_requests  # noqa: E402

from kvserve.bench.profile import KERNEL_KINDS, device_idle, kernel_kind, kernel_rows, profiled_run  # noqa: E402

SERVED = 256         # the served mixed run's requests
BURST = 229          # of them, those it sent in its first five seconds
# The profile tool's kernel kinds, and the elementwise kernels beside them.
KINDS = KERNEL_KINDS + (("norm/act/rope", ("norm", "silu", "rope", "rotary", "act_and_mul")),)


def engine(name: str, model_dir: str):
    """(LLM, sampling params): one greedy token a prompt, so a prompt's work is its prefill."""
    llm, params = dummy_llm(name, model_dir, in_process=True)
    return llm, params(1)


def report(prof, name: str, tokens: int, wall: float, what: str = "burst prefill") -> list[str]:
    rows = kernel_rows(prof, on_gpu=torch.cuda.is_available())
    kinds: dict[str, float] = {}
    for r in rows:
        kind = kernel_kind(r["name"], KINDS)
        kinds[kind] = kinds.get(kind, 0.0) + r["us"] / 1e3
    lines = [f"{name} {what}: {tokens:,} prompt tokens, wall {wall * 1e3:.0f} ms (profiler on), "
             f"{'device kernels' if torch.cuda.is_available() else 'CPU ops'} {sum(kinds.values()):.0f} ms",
             "  " + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))]
    for r in sorted(rows, key=lambda r: -r["us"])[:20]:
        lines.append(f"  {r['us'] / 1e3:9.2f} ms  n={r['calls']:6d}  {r['name'][:96]}")
    return lines + device_idle(prof, 1) if torch.cuda.is_available() else lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("kvserve", "vllm"), required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--requests", type=int, default=BURST)
    a = p.parse_args()
    if not 1 <= a.requests <= SERVED:
        p.error(f"--requests must be in [1, {SERVED}] (the served run's requests), got {a.requests}")
    burst = [r.prompt for r in scenario_requests("mixed", SERVED, a.model_dir)[:a.requests]]
    llm, params = engine(a.engine, a.model_dir)
    profiled_run(llm, [r.prompt for r in scenario_requests("qa", 16, a.model_dir)], params)   # warm: other prompts
    prof, wall = profiled_run(llm, burst, params)
    print("\n".join(report(prof, a.engine, sum(map(len, burst)), wall)))


if __name__ == "__main__":
    main()
