"""Offline throughput benchmark: kvserve vs an optional baseline in one run.

The workload is `num_prompts` random-token prompts of `input_len` tokens each,
generating exactly `output_len` tokens (ignore_eos), as `vllm bench throughput`
does with its random dataset.
"""
from __future__ import annotations

import argparse
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


def run_kvserve(llm, prompts: list[list[int]], output_len: int) -> ThroughputResult:
    from kvserve.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], params.with_max_tokens(2), use_tqdm=False)
    _sync()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    _sync()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != len(prompts) * output_len:
        raise RuntimeError(f"kvserve produced {produced} tokens, expected {len(prompts) * output_len}")
    return ThroughputResult("kvserve", elapsed, len(prompts), len(prompts[0]), output_len)


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
    vocab = llm.engine.model_config.vocab_size
    num_prompts = 1 if a.latency else a.num_prompts
    prompts = random_prompts(num_prompts, a.input_len, vocab, seed=a.seed)
    results = [run_kvserve(llm, prompts, a.output_len)]
    if a.baseline == "hf":
        from kvserve.bench.hf_baseline import run_hf_generate
        device, dtype = llm.engine.runner.device, llm.engine.runner.layout.dtype
        del llm
        results.append(run_hf_generate(a.model, prompts, a.output_len, device, dtype, a.load_format))
    elif a.baseline == "vllm":
        raise ValueError("--baseline vllm needs the vLLM bundle on a GPU machine (see docs/BENCHMARKS.md)")
    print(f"workload: {num_prompts} prompts x {a.input_len} in / {a.output_len} out, model={a.model or 'embedded'}")
    print(format_table(results))
    return 0
