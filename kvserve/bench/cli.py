"""`kvserve bench ...` sub-commands."""
from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: Any) -> None:
    from kvserve.cli import add_engine_args
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    tp = kinds.add_parser("throughput", help="offline throughput (optionally vs HF transformers)")
    add_engine_args(tp)
    tp.add_argument("--num-prompts", type=int, default=16)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=64)
    tp.add_argument("--baseline", choices=["hf", "vllm"], default=None)
    tp.add_argument("--latency", action="store_true", help="batch-1 decode latency mode (1 x 128 in / 256 out)")
    tp.add_argument("--repeats", type=int, default=2, help="timed runs per engine; the best is reported")
    tp.set_defaults(func=_run_throughput)
    _add_serve_bench(kinds)
    from kvserve.bench.sweep import add_sweep_parser
    add_sweep_parser(kinds)


def _run_throughput(a: argparse.Namespace) -> int:
    from kvserve.bench.throughput import run_throughput_cli
    return run_throughput_cli(a)


def _add_serve_bench(kinds: Any) -> None:
    try:
        from kvserve.bench.serve import add_serve_bench_parser
    except ImportError:
        return
    add_serve_bench_parser(kinds)
