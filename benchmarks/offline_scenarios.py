"""The seed scenarios offline and uncapped, one engine per process: qa, long-doc, code-review and
ide-completion from `kvserve.bench.workloads` (seed 0; `--seeds` repeats them with other
prompts), as token ids from one tokenizer, through kvserve's or vLLM's `LLM.generate` (greedy,
ignore_eos, each request's own max_tokens), each scenario timed on its own after one warm-up
request. Each scenario's line and JSON also carry the GPU's mean clocks, power and peak
temperature over its window (`gpu_state.py`; none without nvidia-smi): times compare only at
like clocks.

Each scenario goes in as one batch, code review's later turns included (they share the earlier
turns' text as a prompt prefix). `--turn-waves` orders a review's turns instead: wave k holds every
conversation's k-th turn and starts when wave k-1 is done, as for a client that waits for each
reply; each wave then lasts as long as its longest reply (up to 4,096 tokens), which multiplies
the scenario's time by its number of turns.

    python3 benchmarks/offline_scenarios.py --engine kvserve --model-dir .dummy-qwen3-8b --save-json k.json
    python3 benchmarks/offline_scenarios.py --engine vllm --model-dir .dummy-qwen3-8b --save-json v.json
    python3 benchmarks/offline_scenarios.py --compare k.json v.json    # the table, kvserve / vllm time
"""
from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from kvserve.bench.serve import token_id_prompts
from kvserve.bench.workloads import SCENARIOS, WorkloadGenerator, WorkloadRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_state import GpuStateLog  # noqa: E402

DEFAULT_COUNTS = {"qa": 256, "long-doc": 32, "code-review": 32, "ide-completion": 256}
ENGINE_ARGS = dict(max_model_len=8192, gpu_memory_utilization=0.85, max_num_batched_tokens=8192)


def waves(requests: list[WorkloadRequest]) -> list[list[WorkloadRequest]]:
    """Requests grouped so that each one's `after` sits in an earlier wave."""
    depth: list[int] = []
    for r in requests:
        depth.append(0 if r.after is None else depth[r.after] + 1)
    return [[r for r, d in zip(requests, depth) if d == k] for k in range(max(depth) + 1)]


def scenario_requests(name: str, count: int, model_dir: str, seed: int = 0) -> list[WorkloadRequest]:
    return token_id_prompts(WorkloadGenerator(seed=seed).generate(name, count), model_dir)


def kvserve_runner(model_dir: str, step_trace: str | None = None,
                   dummy_init: str = "kvserve") -> Callable[[list[WorkloadRequest]], int]:
    llm, params = dummy_llm("kvserve", model_dir)
    if dummy_init == "vllm":
        fill_like_vllm(llm.engine.runner.model)
    if step_trace:
        atexit.register(trace_steps(llm.engine, step_trace).close)

    return _generate(llm, params)


def dummy_llm(engine: str, model_dir: str, in_process: bool = False):
    """(LLM, max_tokens -> its SamplingParams) of either engine on dummy weights of `model_dir`'s
    shape, as every comparison here builds them: greedy, ignore_eos, no detokenizing.
    `in_process`: vLLM's engine core in this process, where a profiler sees its kernels."""
    return _kvserve_llm(model_dir) if engine == "kvserve" else _vllm_llm(model_dir, in_process)


def _kvserve_llm(model_dir: str):
    from kvserve import LLM, SamplingParams
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", **ENGINE_ARGS)
    return llm, lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _vllm_llm(model_dir: str, in_process: bool):
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              **ENGINE_ARGS)
    return llm, lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)


def _generate(llm, params) -> Callable[[list[WorkloadRequest]], int]:
    """A batch through `llm.generate`, each request its own max_tokens; its output tokens."""
    def run(batch: list[WorkloadRequest]) -> int:
        outs = llm.generate([{"prompt_token_ids": r.prompt} for r in batch], [params(r.max_tokens) for r in batch],
                            use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return run


def fill_like_vllm(model) -> None:
    """Every parameter Uniform(-1e-3, 1e-3), as vLLM's `initialize_dummy_weights` fills its dummy
    model (norm weights included), in place: the captured graphs keep reading the same memory.
    A compute-bound GEMM's clock depends on the values it multiplies (benchmarks/gemm_data_probe.py),
    so the engines' times compare on the same data only."""
    import torch

    from kvserve.model.loaders.dummy import VLLM_BOUND
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-VLLM_BOUND, VLLM_BOUND)


def trace_steps(engine, path: str):
    """Each `engine.step` a line of `path`, as `KVSERVE_STEP_TRACE` has the served core write
    (kvserve/engine/step_trace.py; no output message here: out_ms 0), device spans included.
    Returns the `StepTrace`: its lines reach the file in batches, the last at `close()`."""
    import torch
    from kvserve.engine.step_trace import StepTrace, now
    trace, step = StepTrace(path), engine.step
    engine.runner.time_steps = torch.cuda.is_available()

    def traced(*args, **kwargs):
        start = now()
        touched = step(*args, **kwargs)
        trace.record(start, now() - start, engine.last_wait_s, 0.0, engine)
        return touched
    engine.step = traced
    return trace


def vllm_runner(model_dir: str) -> Callable[[list[WorkloadRequest]], int]:
    return _generate(*dummy_llm("vllm", model_dir))


def time_scenario(run: Callable[[list[WorkloadRequest]], int], requests: list[WorkloadRequest],
                  turn_waves: bool) -> dict[str, Any]:
    batches = waves(requests) if turn_waves else [requests]
    start, out_tokens = time.perf_counter(), 0
    for batch in batches:
        out_tokens += run(batch)
    seconds = time.perf_counter() - start
    return {"requests": len(requests), "prompt_tokens": sum(len(r.prompt) for r in requests),
            "output_tokens": out_tokens, "seconds": seconds, "batches": len(batches)}


def measure(a: argparse.Namespace) -> dict[str, Any]:
    run = (kvserve_runner(a.model_dir, a.step_trace, a.dummy_init) if a.engine == "kvserve"
           else vllm_runner(a.model_dir))
    warm = scenario_requests("qa", 1, a.model_dir)
    run(warm)
    gpu, results = GpuStateLog.start(), {}
    try:
        for seed, name in [*itertools.product(a.seeds, a.scenarios), *a.also]:
            requests = scenario_requests(name, DEFAULT_COUNTS[name] if a.num_prompts is None else a.num_prompts,
                                         a.model_dir, seed)
            key = name if seed == 0 else f"{name}@{seed}"
            mark = gpu.mark()
            r = results[key] = time_scenario(run, requests, a.turn_waves)
            r["gpu"] = gpu.summary(mark)
            print(f"{a.engine:8s} {key:17s} {r['requests']:5d} req {r['prompt_tokens']:8d} in "
                  f"{r['output_tokens']:8d} out {r['seconds']:8.2f} s {r['output_tokens'] / r['seconds']:9.1f} out tok/s"
                  f"{gpu_text(r['gpu'])}", flush=True)
    finally:
        gpu.stop()
    weights = a.dummy_init if a.engine == "kvserve" else "vllm"
    return {"engine": a.engine, "dummy_weights": weights, "scenarios": results}


def gpu_text(state: dict[str, float]) -> str:
    """A window's GPU state (`gpu_state.GpuStateLog.summary`) as a line's tail; '' without one."""
    if not state:
        return ""
    text = (f"  SM {state['sm_mhz']:.0f} MHz (min {state['sm_mhz_min']:.0f}) {state['power_w']:.0f} W "
            f"max {state['temp_c_max']:.0f} C")
    if "power_capped_pct" in state:   # the share of samples each limit held the clocks back
        text += (f", held back: power {state['power_capped_pct']:.0f}% heat {state['thermal_pct']:.0f}% "
                 f"hw {state['hw_slowdown_pct']:.0f}%")
    return text


def compare(paths: list[str]) -> None:
    """The table of two result files: each scenario's seconds and the first's time over the second's."""
    first, second = (json.load(open(p)) for p in paths)
    e1, e2 = first["engine"], second["engine"]
    print(f"| scenario | requests | {e1} s | {e2} s | {e1} / {e2} time | SM MHz, mean ({e1} / {e2}) | "
          f"W, mean | max C | power-capped % |\n|---|---|---|---|---|---|---|---|---|")
    for name, r1 in first["scenarios"].items():
        r2 = second["scenarios"].get(name)
        if r2 is None:
            continue
        if (r1["output_tokens"], r1["prompt_tokens"]) != (r2["output_tokens"], r2["prompt_tokens"]):
            print(f"| {name} | token counts differ: {r1} vs {r2} | | | | | | | |")
            continue
        print(f"| {name} | {r1['requests']} | {r1['seconds']:.2f} | {r2['seconds']:.2f} | "
              f"{r1['seconds'] / r2['seconds']:.3f}x | {_pair(r1, r2, 'sm_mhz')} | {_pair(r1, r2, 'power_w')} | "
              f"{_pair(r1, r2, 'temp_c_max')} | {_pair(r1, r2, 'power_capped_pct')} |")


def _pair(r1: dict, r2: dict, key: str) -> str:
    """Both runs' GPU figure `key` as "a / b" ("-" for a run without it: older files, no nvidia-smi,
    a driver without the clocks' reasons)."""
    return " / ".join(f"{r['gpu'][key]:.0f}" if key in r.get("gpu", {}) else "-" for r in (r1, r2))


def seeded_scenario(text: str) -> tuple[int, str]:
    """`--also`'s NAME@SEED as (seed, name)."""
    name, _, seed = text.partition("@")
    if name not in SCENARIOS or not seed.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected NAME@SEED with NAME one of {list(SCENARIOS)}, got {text!r}")
    return int(seed), name


def repeated_runs(seeds: list[int], scenarios: list[str], also: list[tuple[int, str]]) -> list[str]:
    """NAME@SEED of each run `--seeds`, `--scenarios` and `--also` ask for more than
    once: its result would overwrite the earlier one's."""
    runs = [*itertools.product(seeds, scenarios), *also]
    return sorted({f"{name}@{seed}" for seed, name in runs if runs.count((seed, name)) > 1})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["kvserve", "vllm"])
    p.add_argument("--model-dir", help="config.json + tokenizer (benchmarks/make_dummy_model.py); dummy weights")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--num-prompts", type=int, default=None, help=f"per scenario (default {DEFAULT_COUNTS})")
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="workload seeds, each scenario once per seed in this order (its own prompts: a "
                        "repeat that hits no prefix cached by the one before); results as NAME@SEED past 0")
    p.add_argument("--also", nargs="+", type=seeded_scenario, default=[], metavar="NAME@SEED",
                   help="more runs after those above, one a scenario and seed (e.g. ide-completion@1)")
    p.add_argument("--turn-waves", action="store_true", help="code review: each turn after the one before")
    p.add_argument("--save-json", default=None)
    p.add_argument("--step-trace", default=None, metavar="FILE",
                   help="kvserve: one line a step (kvserve/engine/step_trace.py's columns; "
                        "python -m kvserve.engine.step_trace FILE --segments reads it)")
    p.add_argument("--dummy-init", choices=["kvserve", "vllm"], default="kvserve",
                   help="kvserve's dummy weights: its loader's (for a model directory: Uniform(-1e-3, 1e-3), "
                        "vLLM's distribution, since 2026-12-06; Normal(0, 0.02) with unit norms before), or "
                        "fill_like_vllm's refill (the same distribution); vLLM always runs its own")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"))
    a = p.parse_args()
    if a.compare:
        return compare(a.compare)
    if not (a.engine and a.model_dir):
        p.error("--engine and --model-dir are required unless --compare is given")
    if a.num_prompts is not None and a.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {a.num_prompts}")
    repeated = repeated_runs(a.seeds, a.scenarios, a.also)
    if repeated:
        p.error(f"each scenario and seed may run once (a result per NAME@SEED), asked more than once: "
                f"{', '.join(repeated)}")
    result = measure(a)
    if a.save_json:
        with open(a.save_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
