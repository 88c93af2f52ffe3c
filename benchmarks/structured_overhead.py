"""Per-step cost of structured output in the batched sampler.

A batch of `--batch` rows over the embedded model's vocabulary (49,152) is
sampled for `--steps` steps, with 0, 1 and all rows constrained by a JSON
schema (xgrammar), greedy. Logits are random, so each constrained row walks
its grammar along whatever the mask allows; the figure is the sampler's time
per step (mask fill for every constrained row + one masked-logits op), which
is what a step pays on top of an unconstrained one.

    python benchmarks/structured_overhead.py [--device cuda] [--batch 32] [--steps 64] [--tokenizer DIR]

`--tokenizer DIR` reads the same SmolLM2 tokenizer from an HF directory
(`benchmarks/make_dummy_model.py` writes one) where the embedded GGUF is not installed.
"""
from __future__ import annotations

import argparse
import time

import torch

from kvserve.model.loaders import embedded_gguf_path
from kvserve.runner.sampler import Sampler
from kvserve.sampling_params import SamplingParams
from kvserve.structured import GrammarCompilerPool

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
VOCAB = 49152


def step_time(device: torch.device, batch: int, constrained: int, steps: int, spec) -> float:
    sampler = Sampler(0, device)
    params = [SamplingParams(temperature=0.0, structured=spec if i < constrained else None,
                             max_tokens=steps + 1) for i in range(batch)]
    ids = [f"r{i}" for i in range(batch)]
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, VOCAB, device=device, generator=gen)
    sampler.sample(logits, params, ids).resolve()   # warm-up: states, buffers
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        sampler.sample(logits, params, ids).resolve()
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--tokenizer", default=None, help="HF directory with the SmolLM2 tokenizer")
    a = p.parse_args()
    from transformers import AutoTokenizer
    if a.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    else:
        path = embedded_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    pool = GrammarCompilerPool(tokenizer, VOCAB, [2])
    t0 = time.perf_counter()
    spec = pool.compile("json_schema", SCHEMA)
    print(f"compile (HTTP side, once per request): {1e3 * (time.perf_counter() - t0):.1f} ms")
    device = torch.device(a.device)
    step_time(device, a.batch, a.batch, 4, spec)   # warm-up: xgrammar's first mask fill / apply
    base = step_time(device, a.batch, 0, a.steps, spec)
    print(f"batch {a.batch}, {a.device}: sampler step without grammar {1e3 * base:.2f} ms")
    for constrained in sorted({1, a.batch // 4, a.batch}):
        t = step_time(device, a.batch, constrained, a.steps, spec)
        print(f"  {constrained:3d} constrained rows: {1e3 * t:.2f} ms/step "
              f"(+{1e3 * (t - base):.2f} ms, {1e3 * (t - base) / constrained:.3f} ms per row)")


if __name__ == "__main__":
    main()
