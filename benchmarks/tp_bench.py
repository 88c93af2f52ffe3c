"""Tensor-parallel throughput and latency on one host's GPUs, per TP size.

For each tensor-parallel size: the anchor workload (256 prompts x 512 in /
128 out, ignore_eos, dummy weights: `kvserve bench throughput`'s defaults on
the GPU) and batch-1 decode (1 x 128 in / 256 out, ms per output token),
then one table. The all-reduce column is arithmetic, not a measurement: two
all-reduces per layer (after attention, after the MLP) of tokens x hidden
model-dtype values each, for a full decode step of the anchor (256 tokens)
and of batch 1; the embedding adds one more of the same size per step.

    python3 benchmarks/tp_bench.py --model dummy:qwen3-8b --tp 1 2
    python3 benchmarks/tp_bench.py --model dummy:llama3-70b --tp 2

Each size runs in its own engine, built after the previous one is closed, so
memory planning sees the whole GPUs every time.
"""
from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass

import torch

from kvserve.bench.throughput import ThroughputResult, random_prompts, run_kvserve
from kvserve.entrypoints.llm import LLM
from kvserve.model.loaders import resolve_model


@dataclass
class TPRow:
    tp: int
    anchor: ThroughputResult
    latency: ThroughputResult | None


def allreduce_bytes_per_step(model: str, tokens: int, dtype_bytes: int = 2) -> int:
    """2 all-reduces per layer x tokens x hidden x bytes per value."""
    config = resolve_model(model, "dummy").config
    return 2 * config.num_hidden_layers * tokens * config.hidden_size * dtype_bytes


def run_size(a: argparse.Namespace, tp: int) -> TPRow:
    llm = LLM(a.model, load_format="dummy", dtype="bfloat16", tensor_parallel_size=tp,
              max_model_len=a.max_model_len, gpu_memory_utilization=a.gpu_memory_utilization)
    try:
        vocab = llm.engine.model_config.vocab_size
        anchor = run_kvserve(llm, random_prompts(a.num_prompts, a.input_len, vocab), a.output_len, a.repeats)
        latency = None if a.skip_latency else run_kvserve(llm, random_prompts(1, 128, vocab, seed=1), 256, a.repeats)
        print(f"tp={tp}: anchor {anchor.output_tok_per_s:.0f} out tok/s"
              + (f", batch-1 {latency.elapsed_s / 256 * 1e3:.2f} ms/token" if latency else ""), flush=True)
        return TPRow(tp, anchor, latency)
    finally:
        channel = llm.engine.runner.step_channel
        if channel is not None:
            channel.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def format_table(a: argparse.Namespace, rows: list[TPRow]) -> str:
    anchor_mb = allreduce_bytes_per_step(a.model, a.num_prompts) / 1e6
    single_kb = allreduce_bytes_per_step(a.model, 1) / 1e3
    head = (f"{'tp':>3} {'anchor s':>9} {'out tok/s':>10} {'total tok/s':>12} {'b1 ms/tok':>10} "
            f"{'AR MB/step@' + str(a.num_prompts):>15} {'AR KB/step@1':>13}")
    lines = [f"model={a.model} anchor={a.num_prompts}x{a.input_len} in/{a.output_len} out, "
             f"batch-1=128 in/256 out, bf16 dummy weights", head, "-" * len(head)]
    for r in rows:
        b1 = f"{r.latency.elapsed_s / r.latency.output_len * 1e3:10.2f}" if r.latency else f"{'-':>10}"
        ar_anchor = f"{anchor_mb:15.1f}" if r.tp > 1 else f"{0:15.1f}"
        ar_single = f"{single_kb:13.1f}" if r.tp > 1 else f"{0:13.1f}"
        lines.append(f"{r.tp:>3} {r.anchor.elapsed_s:9.2f} {r.anchor.output_tok_per_s:10.0f} "
                     f"{r.anchor.total_tok_per_s:12.0f} {b1} {ar_anchor} {ar_single}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:qwen3-8b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to run")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per workload; the best is reported")
    p.add_argument("--skip-latency", action="store_true")
    a = p.parse_args()
    rows = [run_size(a, tp) for tp in a.tp]
    print(format_table(a, rows))


if __name__ == "__main__":
    main()
