"""Keeping Python's cyclic garbage collector off the step loop.

A full (generation 2) collection walks every tracked object. An engine's
start-up builds hundreds of thousands of them (modules, the block pool's
blocks, CUDA graphs' bookkeeping): 136-181 ms a pass for the 332K objects
of a 2-layer Qwen3-8B-shaped engine on a 2-core CPU
(benchmarks/gc_pass_bench.py). Each pass stalls the loop that feeds the GPU;
a served H200 run's worst TTFTs came in such bursts (docs/BENCHMARKS.md).
Frozen objects are skipped by every collection.

The offline `LLM` freezes its start-up heap too, once built (and thaws it
when it goes). Its first full collection otherwise walks that heap in the
middle of the first run: 222 and 252 ms, in one step of the qa scenario's
~5 s, in two processes on one H100 (docs/BENCHMARKS.md, 2026-12-06), the
device idle meanwhile. Within a run nothing more is done: there a run's own
requests stay alive to its end and make up most of what later passes walk.
Tried on a 2-core CPU with 6,000 requests: neither a freeze for the run nor
holding full collections back made its passes fewer or measurably cheaper
(holding them back only moved the pass past the step loop).
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """For a process that lives as long as its engine (the engine core, the
    API server): collect once, then freeze everything built so far, as vLLM
    does."""
    gc.collect()
    gc.freeze()
