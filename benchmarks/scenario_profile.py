"""One offline seed scenario, whole (prefill and decode, each request's own max_tokens), profiled
the same way in either engine: device time by kernel kind, the top kernels, and where the device
sat idle.

`offline_scenarios.py` times the scenarios; this says where two engines' times differ. Both
engines get the same prompt ids in the same order, after the same warm-up (qa prompts: the prefix
cache starts cold for the scenario), greedy with ignore_eos, under torch's profiler recording
device activity only (no CPU ops: their recording would slow the host and with it the steps).

    python3 benchmarks/scenario_profile.py --engine kvserve --model-dir .dummy-qwen3-8b
    PYTHONPATH=$PWD:$PWD/.vsite python3 benchmarks/scenario_profile.py --engine vllm --model-dir .dummy-qwen3-8b
    # --scenario NAME[@SEED] (default ide-completion@0), --count N (default: offline_scenarios.py's)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from burst_prefill_profile import report  # noqa: E402
from offline_scenarios import DEFAULT_COUNTS, dummy_llm, scenario_requests  # noqa: E402


def run(llm, params, requests, profiled: bool):
    """(the profile or None, wall seconds) of one generate over the requests."""
    from torch.profiler import ProfilerActivity, profile
    batch = [{"prompt_token_ids": r.prompt} for r in requests]
    sampling = [params(r.max_tokens) for r in requests]
    on_gpu = torch.cuda.is_available()   # without CUDA (a smoke test): CPU ops
    prof = profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) if profiled else None
    if prof is not None:
        prof.__enter__()
    start = time.perf_counter()
    llm.generate(batch, sampling, use_tqdm=False)
    if on_gpu:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if prof is not None:
        prof.__exit__(None, None, None)
    return prof, wall


def parse_scenario(text: str) -> tuple[str, int]:
    name, _, seed = text.partition("@")
    if name not in DEFAULT_COUNTS:
        raise argparse.ArgumentTypeError(f"unknown scenario {name!r}; choose from {sorted(DEFAULT_COUNTS)}")
    return name, int(seed or 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("kvserve", "vllm"), required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--scenario", type=parse_scenario, default=("ide-completion", 0), help="NAME[@SEED]")
    p.add_argument("--count", type=int, default=None)
    a = p.parse_args()
    name, seed = a.scenario
    requests = scenario_requests(name, a.count or DEFAULT_COUNTS[name], a.model_dir, seed)
    llm, params = dummy_llm(a.engine, a.model_dir, in_process=True)
    run(llm, params, scenario_requests("qa", 16, a.model_dir, seed=7), profiled=False)   # warm: other prompts
    prof, wall = run(llm, params, requests, profiled=True)
    tokens = sum(len(r.prompt) for r in requests)
    print(f"{a.engine} {name}@{seed}: {len(requests)} requests, {sum(r.max_tokens for r in requests):,} output tokens")
    print("\n".join(report(prof, a.engine, tokens, wall, what=f"{name}@{seed}")))


if __name__ == "__main__":
    main()
