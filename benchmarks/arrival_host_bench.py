"""Host microseconds to take in one request (`LLMEngine.make_request` + `add_request`: validation,
the diagnose recorder's prefix hashing, queueing) by prompt length: the engine core pays it
between steps for every arrival, so a burst of long prompts pays it many times a step.

    OMP_NUM_THREADS=1 python benchmarks/arrival_host_bench.py      # CPU, the tiny dummy model
"""
from __future__ import annotations

import random
import time

from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

LENGTHS = (128, 900, 4000, 8000)
REPEATS = 40


def main() -> None:
    engine = LLMEngine(EngineArgs(model="dummy:tiny-llama", load_format="dummy", device="cpu", dtype="float32",
                                  block_size=16, max_model_len=8192, num_kv_blocks=20000,
                                  hf_overrides={"max_position_embeddings": 8192}))
    rng = random.Random(0)
    print("| prompt tokens | make + add us (median of 40) |\n|---:|---:|")
    for n in LENGTHS:
        times = []
        for _ in range(REPEATS):
            prompt = [rng.randrange(3, 250) for _ in range(n)]
            start = time.perf_counter()
            engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=10)))
            times.append(time.perf_counter() - start)
        print(f"| {n:,} | {sorted(times)[REPEATS // 2] * 1e6:.1f} |")


if __name__ == "__main__":
    main()
