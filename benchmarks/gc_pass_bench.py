"""What one full cyclic garbage collection costs an engine's process, before
and after `freeze_startup_heap` (`kvserve/engine/gc_heap.py`).

Builds an engine (CPU by default; `--device cuda` adds the CUDA graphs' heap),
counts the tracked objects and times `gc.collect()` three times, then freezes
the start-up heap and times it again.

    python benchmarks/gc_pass_bench.py                      # 2-layer Qwen3-8B shape, 8 GiB KV, CPU
    python benchmarks/gc_pass_bench.py --device cuda --layers 36
"""
from __future__ import annotations

import argparse
import gc
import time

from kvserve.config import EngineArgs
from kvserve.engine.gc_heap import freeze_startup_heap
from kvserve.engine.llm_engine import LLMEngine


def collect_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:qwen3-8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-memory-gb", type=float, default=8)
    a = p.parse_args()
    engine = LLMEngine(EngineArgs(model=a.model, load_format="dummy", device=a.device, max_model_len=8192,
                                  kv_cache_memory_gb=a.kv_cache_memory_gb, usage="server",
                                  hf_overrides={"num_hidden_layers": a.layers}))
    print(f"{a.model} ({a.layers} layers) on {a.device}: {len(gc.get_objects()):,} tracked objects")
    print("full collection ms:", ", ".join(f"{collect_ms():.1f}" for _ in range(3)))
    freeze_startup_heap()
    print("after freeze_startup_heap:", ", ".join(f"{collect_ms():.2f}" for _ in range(3)))
    del engine


if __name__ == "__main__":
    main()
