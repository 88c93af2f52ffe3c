"""DeepSeek V4 routed experts on one GPU at V4-Flash MoE dims (256 experts,
hidden 4096, intermediate 2048, top-6, bf16): the Triton grouped GEMMs
(kernels/moe.py) against the torch loop over the experts hit
(`MoE.routed_reference`, the path before them), for a top-k routed layer.

    python3 benchmarks/v4_moe_bench.py [--tokens 1 64 256 2048] [--sweep]

Prints the device's copy bandwidth (bytes read + written per second,
kvserve.bench.kernels) and a markdown table per token count T: loop and
kernel time in µs, the routing prep's share of the kernel time, GB/s over
the expert weights the batch must read (distinct experts hit x 3 x H x I x 2
bytes) and its fraction of the copy bandwidth (the bound at small T), and
TFLOP/s (2 x T x k x 3 x H x I: the bound at large T). --sweep times a few
tile configs per T (the default's choice is marked). Timings are
triton.testing.do_bench medians (L2 flushed between runs; 13 GB of expert
weights do not fit in it anyway).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.bench.kernels import copy_bandwidth_gbs  # noqa: E402
from kvserve.model.deepseek_v4.kernels.moe import TileConfig, fused_moe, route, tile_config  # noqa: E402
from kvserve.model.deepseek_v4.layers import MoE  # noqa: E402
from kvserve.model.deepseek_v4.loader import dummy_config  # noqa: E402

DTYPE, DEVICE = torch.bfloat16, "cuda"
SWEEP = [TileConfig(16, 64, 128, 4, 3), TileConfig(16, 32, 128, 4, 4), TileConfig(16, 128, 64, 4, 3),
         TileConfig(32, 64, 128, 4, 3), TileConfig(64, 128, 64, 8, 3), TileConfig(64, 64, 64, 4, 4),
         TileConfig(128, 128, 64, 8, 3)]


def _us(fn) -> float:
    return do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def flash_moe() -> MoE:
    """The last (top-k routed) layer of V4-Flash with random weights."""
    config = dummy_config("deepseek-v4-flash")
    torch.set_default_dtype(DTYPE)
    with torch.device(DEVICE):
        moe = MoE(config, config.num_hidden_layers - 1)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return moe.requires_grad_(False).eval()


class Case:
    """T tokens routed by the layer's own router, and what they must read and compute."""

    def __init__(self, moe: MoE, num_tokens: int) -> None:
        self.moe, self.num_tokens = moe, num_tokens
        self.x = torch.randn(num_tokens, moe.w1.shape[2], device=DEVICE, dtype=DTYPE)
        ids = torch.randint(0, 129280, (num_tokens,), device=DEVICE)
        self.weights, self.indices = moe.gate(self.x, ids)
        num_experts, inter, hidden = moe.w1.shape
        self.experts_hit = int(self.indices.unique().numel())
        self.weight_bytes = self.experts_hit * 3 * hidden * inter * moe.w1.element_size()
        self.flops = 2 * self.indices.numel() * 3 * hidden * inter

    def kernel(self, config: TileConfig | None = None):
        m = self.moe
        return lambda: fused_moe(self.x, m.w1, m.w3, m.w2, self.weights, self.indices, m.limit, config)

    def loop(self):
        return lambda: self.moe.routed_reference(self.x, self.weights, self.indices)

    def difference(self) -> float:
        """||kernel - loop|| / ||loop||: a sanity check that both computed the same thing."""
        got, expected = self.kernel()().float(), self.loop()().float()
        return float((got - expected).norm() / expected.norm())

    def route(self):
        block_m = tile_config(self.indices.numel(), self.moe.w1.shape[0], DTYPE).block_m
        return lambda: route(self.indices, self.moe.w1.shape[0], block_m)


def report(cases: list[Case], copy_gbs: float) -> None:
    print("| T | experts hit | loop µs | kernel µs | speedup | routing prep | weights GB/s | % of copy | TFLOP/s "
          "| rel. diff vs loop |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        loop, kernel, prep = _us(case.loop()), _us(case.kernel()), _us(case.route())
        gbs = case.weight_bytes / kernel / 1e3
        print(f"| {case.num_tokens} | {case.experts_hit} | {loop:.0f} | {kernel:.0f} | {loop / kernel:.1f}x | "
              f"{100 * prep / kernel:.0f} % | {gbs:.0f} | {100 * gbs / copy_gbs:.0f} % | "
              f"{case.flops / kernel / 1e6:.1f} | {case.difference():.1e} |")


def sweep(cases: list[Case]) -> None:
    print("\n| T | block_m | block_n | block_k | warps | stages | kernel µs |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        chosen = tile_config(case.indices.numel(), case.moe.w1.shape[0], DTYPE)
        for config in SWEEP:
            mark = " (default)" if config == chosen else ""
            print(f"| {case.num_tokens} | {config.block_m} | {config.block_n} | {config.block_k} | "
                  f"{config.num_warps} | {config.num_stages} | {_us(case.kernel(config)):.0f}{mark} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    parser.add_argument("--sweep", action="store_true", help="time a few tile configs per token count")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("v4_moe_bench needs a CUDA device")
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s\n")
    moe = flash_moe()
    cases = [Case(moe, t) for t in args.tokens]
    report(cases, copy_gbs)
    if args.sweep:
        sweep(cases)


if __name__ == "__main__":
    main()
