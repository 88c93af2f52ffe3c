"""Decode-attention config sweep at the batches and contexts the KV-pressure runs decode at
(H200, 2026-11-29): which (block_n, num_stages, num_warps, waves) reads the paged cache fastest.

  python3 benchmarks/decode_sweep.py [--page 16] [--batches 8 24 48] [--contexts 1024 2048 3712 8192]
  python3 benchmarks/decode_sweep.py --table 64/3/4/4 32/4/2/8 ...   # block_n/stages/warps/waves
  python3 benchmarks/decode_sweep.py --table 32/4/2/4/3 32/4/2/4/5 ... # .../splits: a fixed split count

Prints, per (batch, context), the default config's % of copy bandwidth and the best five
(or, with --table, every listed config's %). Each config is timed replaying a CUDA graph of its
launches (`do_bench_cudagraph`, L2 kept warm, as a decode graph runs); `--no-graph` times eager
launches with L2 flushed between them (`do_bench`, the sweeps before 2026-12-04: ~30 us kernels
then read 25-52% of copy for one config in one row).
"""
import argparse
import itertools

import torch
from triton.testing import do_bench, do_bench_cudagraph

from kvserve.attention.kernels import DecodeConfig
from kvserve.bench.kernels import PagedBatch, copy_bandwidth_gbs, decode_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 24, 48])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 3712, 8192])
    p.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4, 5])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--waves", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--table", nargs="+", default=None)
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--no-graph", action="store_true", help="eager launches, L2 flushed (do_bench)")
    a = p.parse_args()
    torch.manual_seed(0)
    copy = copy_bandwidth_gbs()
    grid = ([[int(x) for x in t.split("/")] for t in a.table] if a.table else
            itertools.product(a.block_n, a.stages, a.warps, a.waves))
    # block_n/stages/warps/waves, optionally /splits (a fixed split count instead of the plan)
    configs = [DecodeConfig.uniform(n, w, s, waves=v, num_splits=rest[0] if rest else None)
               for n, s, w, v, *rest in grid]
    if a.table:
        print("batch   ctx  " + "  ".join(f"{t:>11}" for t in a.table))
    print(f"copy {copy:.0f} GB/s, page {a.page}, {len(configs)} configs")
    for batch in a.batches:
        paged = PagedBatch(batch, max(a.contexts), a.page)
        for ctx in a.contexts:
            def pct(cfg, paged=paged):
                run = paged.decode(ctx, cfg)
                ms = (do_bench(run, warmup=10, rep=a.rep, return_mode="median") if a.no_graph
                      else do_bench_cudagraph(run, rep=a.rep, return_mode="median"))
                return decode_bytes(batch, ctx) / ms / 1e6 / copy
            if a.table:
                print(f"{batch:5d} {ctx:5d}  " + "  ".join(f"{pct(c):11.0%}" for c in configs), flush=True)
                continue
            base = pct(DecodeConfig())
            ranked = sorted(((pct(c), c) for c in configs), key=lambda t: -t[0])
            best = "  ".join(f"n{c.block_n}/s{c.num_stages}/w{c.num_warps}/v{c.waves} {r:.0%}"
                             for r, c in ranked[:5])
            print(f"batch {batch:3d} ctx {ctx:5d}: default {base:.0%} | {best}", flush=True)
        del paged
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
