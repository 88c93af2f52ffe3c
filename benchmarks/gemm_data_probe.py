"""Does a bf16 GEMM's time depend on the values it multiplies? The two engines' dummy weights differ:
kvserve draws Normal(0, 0.02) matrices with unit norm weights (activations of order 1), vLLM fills
every parameter Uniform(-1e-3, 1e-3) (`initialize_dummy_weights`; its RMSNorm then scales
activations to ~1e-3). A compute-bound GEMM runs at the clock the power limit allows, and the
power drawn depends on the bits the tensor cores toggle, so the same cuBLAS kernel on the same
shape may take longer on one engine's data than on the other's.

Qwen3-8B's layer GEMMs (qkv, o, gate_up, down) at 8,192 tokens (a prefill step, compute-bound) and
64 (a decode step, bound by the weights' bytes), each with both engines' data, in alternating
rounds (clock drift falls on both), as CUDA graph replays:

    python3 benchmarks/gemm_data_probe.py [--rounds 5] [--tokens 8192 64]
"""
from __future__ import annotations

import argparse
import statistics

import torch

HIDDEN, INTER, Q, KV = 4096, 12288, 4096, 1024
SHAPES = {"qkv": (HIDDEN, Q + 2 * KV), "o": (Q, HIDDEN), "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN)}


def operands(kind: str, tokens: int, k: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [tokens, k], w [n, k]) as each engine's dummy model feeds a layer GEMM."""
    x = torch.randn(tokens, k, device="cuda", generator=gen)
    if kind == "kvserve":
        return x.bfloat16(), (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    scale = torch.empty(k, device="cuda").uniform_(-1e-3, 1e-3, generator=gen)   # the norm's weight
    w = torch.empty(n, k, device="cuda").uniform_(-1e-3, 1e-3, generator=gen)
    return (x * scale).bfloat16(), w.bfloat16()


def graph_ms(x: torch.Tensor, w: torch.Tensor, reps: int = 20) -> float:
    """Median ms of one GEMM, timed as a graph of `reps` replays of it."""
    out = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16)
    torch.matmul(x, w.t(), out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            torch.matmul(x, w.t(), out=out)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 64])
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; ms a GEMM, median of {a.rounds} alternating rounds")
    print(f"{'tokens':>6s} {'gemm':8s} {'kvserve':>9s} {'vllm':>9s} {'kvserve/vllm':>13s} {'TFLOP/s (kvserve, vllm)':>24s}")
    for tokens in a.tokens:
        for name, (k, n) in SHAPES.items():
            data = {kind: operands(kind, tokens, k, n, gen) for kind in ("kvserve", "vllm")}
            runs = {kind: [] for kind in data}
            for _ in range(a.rounds):
                for kind in data:
                    runs[kind].append(graph_ms(*data[kind]))
            ms = {kind: statistics.median(v) for kind, v in runs.items()}
            flops = 2 * tokens * k * n
            print(f"{tokens:6d} {name:8s} {ms['kvserve']:9.4f} {ms['vllm']:9.4f} {ms['kvserve'] / ms['vllm']:13.4f} "
                  f"{flops / ms['kvserve'] / 1e9:11.0f} {flops / ms['vllm'] / 1e9:11.0f}", flush=True)


if __name__ == "__main__":
    main()
