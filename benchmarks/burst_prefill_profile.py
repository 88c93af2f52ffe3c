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
    # --requests N: the burst's first N requests (default 229). Without CUDA it runs but times no kernels.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_scenarios import ENGINE_ARGS, scenario_requests  # noqa: E402

from kvserve.bench.profile import device_idle  # noqa: E402

BURST = 229          # requests the served run sent in its first five seconds (of 256)
# Kernel kinds by name, as step_diagnostics.py's prefill8k (vLLM's FA3 kernels say "flash").
KINDS = (("attention", ("_prefill", "_decode", "attn", "fmha", "flash")),
         ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
         ("norm/act/rope", ("norm", "silu", "rope", "rotary", "act_and_mul")),
         ("memset/copy", ("memset", "memcpy", "copy", "fill")))


def generate_fn(engine: str, model_dir: str):
    """A function of token-id prompts that prefills them (one greedy token each)."""
    if engine == "kvserve":
        from kvserve import LLM, SamplingParams
        llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", **ENGINE_ARGS)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    else:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # its kernels in this process
        from vllm import LLM, SamplingParams
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                  **ENGINE_ARGS)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    return lambda prompts: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def kind_of(name: str) -> str:
    return next((kind for kind, keys in KINDS if any(k in name.lower() for k in keys)), "other")


def report(prof, engine: str, tokens: int, wall: float) -> list[str]:
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0 and not e.key.startswith("kvserve::")]
    kinds: dict[str, float] = {}
    for e in events:
        kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0.0) + e.self_device_time_total / 1e3
    lines = [f"{engine} burst prefill: {tokens:,} prompt tokens, wall {wall * 1e3:.0f} ms (profiler on), "
             f"device kernels {sum(kinds.values()):.0f} ms",
             "  " + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:20]:
        lines.append(f"  {e.self_device_time_total / 1e3:9.2f} ms  n={e.count:6d}  {e.key[:96]}")
    return lines + device_idle(prof, 1) if events else lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("kvserve", "vllm"), required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--requests", type=int, default=BURST)
    a = p.parse_args()
    burst = [r.prompt for r in scenario_requests("mixed", 256, a.model_dir)[:a.requests]]
    generate = generate_fn(a.engine, a.model_dir)
    generate([r.prompt for r in scenario_requests("qa", 16, a.model_dir)])   # compiles, graphs; other prompts
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        generate(burst)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    print("\n".join(report(prof, a.engine, sum(map(len, burst)), wall)))


if __name__ == "__main__":
    main()
