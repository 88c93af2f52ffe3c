"""What a prompt chunk beside running decodes costs a step: decode-only steps against mixed steps
at the same batch, the regime of a server under Poisson arrivals (ide-completion: ~50 running,
~1K-token contexts, a new prompt every other step whose 700-token file prefix is cached).

N requests decode (prompt: one of 4 shared 700-token prefixes plus a unique suffix). Then:
  decode   steps with the N decoding, nothing admitted;
  mixed-S  each step admits one new request (a cached prefix plus S new tokens) and aborts the
           oldest, so the batch stays at N decodes plus one S-token chunk.
Each phase's ms per step is wall clock over its steps after one warm-up step (pipelined steps
under CUDA graphs: the device time per step once the device is the bottleneck). `--profile`
adds a torch.profiler pass per phase: the top device kernels' microseconds per step.
Each phase also prints the host ms per step: `LLMEngine.step` less its wait for the step in
flight. A phase whose host ms reaches its ms/step is bound by the host, not the device.
`--host-profile` adds a cProfile of the last mixed phase's steps, and `--sync-check` runs a few
of its steps in CUDA sync-debug mode, printing where each synchronising call came from.

    python3 benchmarks/mixed_step_bench.py --model dummy:qwen3-8b --device cuda --profile
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time
import traceback
import warnings

import torch

from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

PREFIX_LEN = 700


def build(a: argparse.Namespace) -> LLMEngine:
    return LLMEngine(EngineArgs(model=a.model, device=a.device, dtype=a.dtype, max_model_len=4096,
                                max_num_seqs=max(a.running * 2, 64), max_num_batched_tokens=8192,
                                load_format="dummy", usage="server", enforce_eager=a.enforce_eager,
                                gpu_memory_utilization=0.85,
                                hf_overrides=json.loads(a.hf_overrides) if a.hf_overrides else None))


class Traffic:
    """Prompts over 4 shared prefixes; keeps the batch at `running` decodes."""

    def __init__(self, engine: LLMEngine, a: argparse.Namespace) -> None:
        self.engine, self.rng = engine, random.Random(0)
        vocab = engine.model_config.vocab_size
        self.prefixes = [[self.rng.randrange(3, vocab) for _ in range(PREFIX_LEN)] for _ in range(4)]
        self.vocab, self.order = vocab, []
        self.params = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0)

    def add(self, new_tokens: int) -> None:
        prompt = self.rng.choice(self.prefixes) + [self.rng.randrange(3, self.vocab) for _ in range(new_tokens)]
        request = self.engine.make_request(prompt, self.params)
        self.engine.add_request(request)
        self.order.append(request.request_id)

    def swap_one(self, new_tokens: int) -> None:
        self.engine.abort_request(self.order.pop(0))
        self.add(new_tokens)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(engine: LLMEngine, traffic: Traffic, steps: int, new_tokens: int | None) -> tuple[float, float]:
    """ms per step over `steps` steps (one warm-up step first), and the median host ms of a step."""
    host = []

    def one() -> None:
        if new_tokens is not None:
            traffic.swap_one(new_tokens)
        start = time.perf_counter()
        engine.step()
        host.append((time.perf_counter() - start - engine.last_wait_s) * 1e3)
    one()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    _sync()
    return (time.perf_counter() - start) / steps * 1e3, statistics.median(host[1:])


def host_profile(engine: LLMEngine, traffic: Traffic, steps: int, new_tokens: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    timed(engine, traffic, steps, new_tokens)
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(20)


def sync_check(engine: LLMEngine, traffic: Traffic, steps: int, new_tokens: int) -> None:
    """Run `steps` mixed steps in sync-debug mode; print each synchronising call's stack once."""
    seen = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        stack = "".join(traceback.format_stack()[-8:-2])
        if stack not in seen:
            seen.add(stack)
            print(f"SYNC: {message}\n{stack}")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():   # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = show
            for _ in range(steps):
                traffic.swap_one(new_tokens)
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"sync check: {len(seen)} distinct synchronising call stacks in {steps} mixed steps")


def top_kernels(engine: LLMEngine, traffic: Traffic, steps: int, new_tokens: int | None,
                top: int) -> list[tuple[str, float]]:
    """(kernel, device us per step) of the `top` kernels over `steps` + 1 steps."""
    from torch.profiler import ProfilerActivity, profile

    from kvserve.bench.profile import kernel_rows
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed(engine, traffic, steps, new_tokens)
    return [(r["name"], r["us"] / (steps + 1)) for r in kernel_rows(prof, on_gpu=True)[:top]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:qwen3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--running", type=int, default=48)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--chunks", default="16,200", help="new tokens of the admitted prompt, per mixed phase")
    p.add_argument("--hf-overrides", default=None, help="JSON merged into the model config")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--host-profile", action="store_true")
    p.add_argument("--sync-check", action="store_true")
    a = p.parse_args()
    engine = build(a)
    traffic = Traffic(engine, a)
    for _ in range(a.running):
        traffic.add(200 + traffic.rng.randrange(100))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    phases = [("decode", None)] + [(f"mixed-{s}", int(s)) for s in a.chunks.split(",")]
    print(f"model={a.model} running={a.running} steps={a.steps} graphs={'off' if a.enforce_eager else 'on'}")
    for name, new_tokens in phases:
        ms, host_ms = timed(engine, traffic, a.steps, new_tokens)
        print(f"{name:>10}: {ms:7.2f} ms/step   host {host_ms:6.2f} ms/step")
    if a.sync_check:
        sync_check(engine, traffic, 6, phases[-1][1])
    if a.host_profile:
        host_profile(engine, traffic, a.steps, phases[-1][1])
    if a.profile:
        for name, new_tokens in phases:
            print(f"-- {name}: device us per step, top kernels")
            for kernel, us in top_kernels(engine, traffic, 10, new_tokens, 8):
                print(f"   {us:9.1f}  {kernel[:90]}")


if __name__ == "__main__":
    main()
