"""Offline throughput benchmark: kvserve vs an optional baseline in one run.

The workload is `num_prompts` random-token prompts of `input_len` tokens each,
generating exactly `output_len` tokens (ignore_eos), as `vllm bench throughput`
does with its random dataset.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch


@dataclass
class ThroughputResult:
    engine: str
    elapsed_s: float
    num_prompts: int
    input_len: int
    output_len: int

    @property
    def requests_per_s(self) -> float:
        return self.num_prompts / self.elapsed_s

    @property
    def output_tok_per_s(self) -> float:
        return self.num_prompts * self.output_len / self.elapsed_s

    @property
    def total_tok_per_s(self) -> float:
        return self.num_prompts * (self.input_len + self.output_len) / self.elapsed_s


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the lowest ids, where special tokens live in most vocabularies.
    low = min(1000, vocab_size // 4)
    return torch.randint(low, vocab_size, (num_prompts, input_len), generator=gen).tolist()


def run_kvserve(llm, prompts: list[list[int]], output_len: int, repeats: int = 1) -> ThroughputResult:
    """Best of `repeats` timed runs; the prefix cache is emptied before each so
    a repeat cannot hit the KV of the run before it."""
    from kvserve.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], params.with_max_tokens(2), use_tqdm=False)
    best = float("inf")
    for _ in range(repeats):
        if not llm.engine.kv_cache.reset_prefix_cache():
            raise RuntimeError("prefix cache could not be reset between repeats (blocks still held)")
        _sync()
        profiler = _maybe_profiler()
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
        _sync()
        best = min(best, time.perf_counter() - start)
        if profiler is not None:
            _dump_profile(profiler)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        if produced != len(prompts) * output_len:
            raise RuntimeError(f"kvserve produced {produced} tokens, expected {len(prompts) * output_len}")
    return ThroughputResult("kvserve", best, len(prompts), len(prompts[0]), output_len)


def _maybe_profiler():
    """KVSERVE_PROFILE=FILE: host-side cProfile of the timed run (where the CPU time goes)."""
    if not os.environ.get("KVSERVE_PROFILE"):
        return None
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _dump_profile(profiler) -> None:
    import pstats
    profiler.disable()
    with open(os.environ["KVSERVE_PROFILE"], "w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def format_table(results: list[ThroughputResult]) -> str:
    head = f"{'engine':<14}{'time s':>9}{'req/s':>9}{'out tok/s':>12}{'total tok/s':>13}"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{r.engine:<14}{r.elapsed_s:>9.2f}{r.requests_per_s:>9.2f}"
                    f"{r.output_tok_per_s:>12.1f}{r.total_tok_per_s:>13.1f}")
    if len(results) == 2:
        rows.append(f"ratio kvserve / {results[1].engine}: "
                    f"{results[0].output_tok_per_s / results[1].output_tok_per_s:.2f}x output tok/s")
    return "\n".join(rows)


def run_throughput_cli(a: argparse.Namespace) -> int:
    from kvserve.cli import engine_kwargs
    from kvserve.entrypoints.llm import LLM
    llm = LLM(**engine_kwargs(a))
    engine = llm.engine
    num_prompts, input_len, output_len = (1, 128, 256) if a.latency else (a.num_prompts, a.input_len, a.output_len)
    prompts = random_prompts(num_prompts, input_len, engine.model_config.vocab_size, seed=a.seed)
    results = [run_kvserve(llm, prompts, output_len, a.repeats)]
    device, dtype = engine.runner.device, engine.runner.layout.dtype
    max_model_len = engine.scheduler_config.max_model_len
    num_params = sum(p.numel() for p in engine.runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    del llm, engine
    results += _baselines(a, prompts, output_len, device, dtype, max_model_len)
    print(f"workload: {num_prompts} prompts x {input_len} in / {output_len} out, model={a.model or 'embedded'}")
    print(format_table(results))
    if device.type == "cuda":
        print(format_limits(results, num_params, weight_bytes, device))
    return 0


def _baselines(a: argparse.Namespace, prompts: list[list[int]], output_len: int, device: torch.device,
               dtype: torch.dtype, max_model_len: int) -> list[ThroughputResult]:
    if a.baseline == "hf":
        from kvserve.bench.hf_baseline import run_hf_generate
        return [run_hf_generate(a.model, prompts, output_len, device, dtype, a.load_format, a.repeats)]
    if a.baseline == "vllm":
        from kvserve.bench.vllm_baseline import run_vllm_generate
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return [run_vllm_generate(a.model, prompts, output_len, max_model_len, a.gpu_memory_utilization)]
    return []


def format_limits(results: list[ThroughputResult], num_params: int, weight_bytes: int,
                  device: torch.device) -> str:
    """MFU against the measured bf16 matmul rate; ms/token against the weight-read floor."""
    from kvserve.bench.device_limits import measure_device_limits
    limits = measure_device_limits(device)
    rows = [f"device limits (measured): bf16 matmul {limits.matmul_flops / 1e12:.0f} TFLOP/s, "
            f"copy {limits.copy_bytes_per_s / 1e9:.0f} GB/s (read+write)"]
    floor_ms = weight_bytes / limits.copy_bytes_per_s * 1e3
    for r in results:
        tokens = r.num_prompts * (r.input_len + r.output_len)
        mfu = tokens * 2 * num_params / r.elapsed_s / limits.matmul_flops
        ms_per_token = r.elapsed_s / r.output_len * 1e3
        rows.append(f"{r.engine:<16} MFU {mfu:6.1%}   {ms_per_token:7.2f} ms/step "
                    f"(weight-read floor {floor_ms:.2f} ms, {floor_ms / ms_per_token:5.1%} of floor speed)")
    return "\n".join(rows)
