"""The TMA path's two kernels side by side: Triton (`prefill_tma.py`) against Gluon (`prefill_gluon.py`),
and the paged kernel's large tiles (what a large eager step runs off the TMA path).

Qwen3-8B heads (32 / 8, head_dim 128), bf16, block size 16, on the shapes of a served 8K-token
eager step: fresh prompts (1 x 8,192, 2 x 4,096, 8 x 1,024, the mixed burst's ragged step), chunks
after cached prefixes, and a burst step with some cached file prefixes. Each row prints both
kernels' times (do_bench_cudagraph), Gluon's time over Triton's and over the paged kernel's, and
the largest relative difference of the outputs to the paged kernel's (the GPU tests check each
against a float32 reference). The steps past "burst with prefixes" are those the TMA path's
gates (`mixed.TMA_MIN_FRESH_SHARE`, `TMA_MIN_LONGEST_CHUNK`) keep on the paged kernel.

    python3 benchmarks/tma_kernel_ab.py
    # the Gluon kernel's builds offline, without a GPU: benchmarks/gluon_prefill_probe.py --compile-only
"""
from __future__ import annotations

import itertools

import torch
from triton.testing import do_bench, do_bench_cudagraph

from kvserve.attention.kernels.mixed import LARGE_TILES
from kvserve.attention.kernels.prefill import prefill_attention
from kvserve.attention.kernels.prefill_gluon import prefill_attention_gluon
from kvserve.attention.kernels.prefill_tma import prefill_attention_tma
from prefill_headroom import HEAD_DIM, HEADS, KV_HEADS, RAGGED, RAGGED_PREFIXED, ragged_cache

# (cached prefix, new tokens) rows of one step
STEPS = {"1 x 8192": [(0, 8192)], "2 x 4096": [(0, 4096)] * 2, "8 x 1024": [(0, 1024)] * 8,
         "burst ragged": [(0, n) for n in RAGGED], "1 x 4096 after 4096": [(4096, 4096)],
         "2 x 2048 after 2000": [(2000, 2048)] * 2, "4 x 512 after 1504": [(1504, 512)] * 4,
         "3 x 1000 after 7000": [(7000, 1000)] * 3, "burst with prefixes": RAGGED_PREFIXED[:-1],
         "1 x 2048 after 6000": [(6000, 2048)], "2 x 1500 after 5000": [(5000, 1500)] * 2,
         "1 x 2048 after 30000": [(30000, 2048)], "4 x 512 after 7000": [(7000, 512)] * 4,
         "16 x 256": [(0, 256)] * 16, "32 x 64 after 700": [(700, 64)] * 32, "64 x 32": [(0, 32)] * 64}


def step_inputs(rows: list[tuple[int, int]]):
    """q and this step's k/v (the chunks' rows), the cache holding prefixes and chunks, the metadata."""
    totals = [p + n for p, n in rows]
    k_all, v_all = torch.randn(2, sum(totals), KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    cache, table = ragged_cache(k_all, v_all, totals)
    fresh = torch.cat([torch.arange(a + p, a + p + n) for a, (p, n) in
                       zip(itertools.accumulate([0] + totals[:-1]), rows)]).cuda()
    news = [n for _, n in rows]
    q = torch.randn(sum(news), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.tensor([0] + list(itertools.accumulate(news)), dtype=torch.int32, device="cuda")
    lens = torch.tensor(totals, dtype=torch.int32, device="cuda")
    return q, k_all[fresh], v_all[fresh], cache, table, starts, lens, max(news)


def timed_us(run) -> float:
    """do_bench_cudagraph, or do_bench where the launch cannot be captured (a host sync in its plan)."""
    try:
        return do_bench_cudagraph(run, rep=100) * 1e3
    except Exception:  # noqa: BLE001
        return do_bench(run, warmup=25, rep=100) * 1e3


def compare(label: str, rows: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    q, k, v, cache, table, starts, lens, top = step_inputs(rows)
    prefixes = any(p for p, _ in rows)
    outs = [torch.full_like(q, float("nan")) for _ in range(3)]
    scale, longest = HEAD_DIM ** -0.5, int(lens.max())
    runs = [lambda: prefill_attention_tma(q, k, v, cache, outs[0], table, starts, lens, top, scale,
                                          single_queries=False, cached_prefixes=prefixes),
            lambda: prefill_attention_gluon(q, k, v, cache, outs[1], table, starts, lens, top, scale,
                                            cached_prefixes=prefixes),
            lambda: prefill_attention(q, cache, outs[2], table, starts, lens, top, scale, None, 0, LARGE_TILES,
                                      single_queries=False, max_seq_len=longest)]
    for run in runs:
        run()
    ref = outs[2].float()
    diff = max(((out.float() - ref).norm() / ref.norm()).item() for out in outs[:2])
    us = [timed_us(run) for run in runs]
    flops = sum(4 * HEADS * HEAD_DIM * (n * p + n * (n + 1) // 2) for p, n in rows)
    print(f"{label:<22} triton {us[0]:7.1f} us  gluon {us[1]:7.1f} us {flops / us[1] / 1e6:5.1f} TFLOP/s  "
          f"paged {us[2]:7.1f} us  gluon/triton {us[1] / us[0]:.3f}  gluon/paged {us[1] / us[2]:.3f}  "
          f"max rel diff {diff:.1e}", flush=True)

def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    for label, rows in STEPS.items():
        try:
            compare(label, rows)
        except Exception as e:  # noqa: BLE001 - a shape that fails is a row
            print(f"{label:<22} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main()
