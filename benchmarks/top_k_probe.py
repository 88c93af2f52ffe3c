"""Where the V4 indexer's top-k time goes, stage by stage, and whether prefetching the next tile pays.

The top-k (`kvserve/model/deepseek_v4/kernels/indexer.py`, one program a row) takes 88 us at 256
rows and 55 us at 64 on an H100 at 128K context (32,768 scores a row), while its rows are only
32 MB, read from the L2. Its long-row path runs three stages in a program:
  1. `_group_bound`: the maxima of groups of GROUP scores (tiles of BLOCK), then the k-th
     largest of those maxima by radix passes: a bound under the row's k-th score;
  2. `_compact_candidates`: the scores at or above the bound, in entry order, COMPACT a step
     (a prefix sum a step);
  3. `_top_k_of_candidates`: the top k of the candidates by radix passes, written in order.
This probe times, on the scores of the real score kernel (random pages, `v4_kernel_bench.py`'s
`DecodePages`), programs that stop after each stage, one that only reads the row once (the
floor of one pass), and the production kernel. Then the same stages with the next tile's loads
issued before the current tile is processed ("prefetch"): Triton does not pipeline loads that
feed no dot, so each tile's load otherwise waits out the L2's latency in turn. The prefetched
full path is checked against the production kernel's indices (exact). The production kernel
runs without and with `TopKConfig.group_list` (compact from the groups whose maximum reaches
the bound only; `TOP_K_CONFIG` has it), the second checked against the first's indices. The
staged programs compact from the whole row.

    python3 benchmarks/top_k_probe.py [--batches 64 256] [--contexts 32768 131072]

Times: triton.testing.do_bench_cudagraph medians (no launch gaps), us.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from v4_kernel_bench import CSA_RATE, TOPK, DecodePages  # noqa: E402

from kvserve.model.deepseek_v4.kernels import indexer  # noqa: E402
from kvserve.model.deepseek_v4.kernels.indexer import (_append_candidates, _compact_candidates,  # noqa: E402
                                                       _group_bound, _radix_tile, _sortable, _tile_and_warps,
                                                       _top_k_of_candidates, _compact_step)


@triton.jit
def _read_row(score_row, num_entries, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """One pass over the row (a sum, so the loads are kept): the floor of a stage's pass."""
    acc = tl.zeros([BLOCK], tl.float32)
    if PREFETCH:
        e = tl.arange(0, BLOCK)
        nxt = tl.load(score_row + e, mask=e < num_entries, other=0.0)
    for e0 in range(0, num_entries, BLOCK):
        if PREFETCH:
            cur = nxt
            e = e0 + BLOCK + tl.arange(0, BLOCK)
            nxt = tl.load(score_row + e, mask=e < num_entries, other=0.0)
        else:
            e = e0 + tl.arange(0, BLOCK)
            cur = tl.load(score_row + e, mask=e < num_entries, other=0.0)
        acc += cur
    return tl.sum(acc, 0)


@triton.jit
def _group_bound_pf(score_row, max_row, num_entries, num_groups, k, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_G: tl.constexpr, BITS: tl.constexpr):
    """`_group_bound` with the next tile's scores loaded before this tile's maxima."""
    e = tl.arange(0, BLOCK)
    nxt = tl.load(score_row + e, mask=e < num_entries, other=float("-inf"))
    for e0 in range(0, num_entries, BLOCK):
        score = nxt
        e = e0 + BLOCK + tl.arange(0, BLOCK)
        nxt = tl.load(score_row + e, mask=e < num_entries, other=float("-inf"))
        group_max = _sortable(tl.max(tl.reshape(score, [BLOCK // GROUP, GROUP]), 1))
        g = e0 // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(max_row + g, group_max.to(tl.int32, bitcast=True), mask=g < num_groups)
    tl.debug_barrier()
    g = tl.arange(0, BLOCK_G)
    maxima = tl.load(max_row + g, mask=g < num_groups, other=0).to(tl.uint32, bitcast=True)
    bound, _, _ = _radix_tile(maxima, g < num_groups, k, BITS)
    return bound


@triton.jit
def _compact_pf(score_row, cand_key_row, cand_idx_row, num_entries, bound, BLOCK: tl.constexpr, CAND: tl.constexpr):
    """`_compact_candidates` with the next step's scores loaded before this step's prefix sum."""
    count = tl.zeros([], tl.int32)
    e = tl.arange(0, BLOCK)
    nxt = tl.load(score_row + e, mask=e < num_entries, other=0.0)
    for e0 in range(0, num_entries, BLOCK):
        score = nxt
        e = e0 + BLOCK + tl.arange(0, BLOCK)
        nxt = tl.load(score_row + e, mask=e < num_entries, other=0.0)
        here = e0 + tl.arange(0, BLOCK)
        count = _append_candidates(_sortable(score), here < num_entries, here, bound, count, cand_key_row,
                                   cand_idx_row, CAND)
    return count


@triton.jit
def _stage_kernel(scores_ptr, stride_st, out_ptr, stride_ot, scratch_ptr, stride_scratch, num_entries, k,
                  STAGE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr, CAND: tl.constexpr, COMPACT: tl.constexpr, BITS: tl.constexpr):
    """Row t's long-row path up to STAGE (0: one read of the row; 1: the bound; 2: and the
    candidates; 3: and the top k, written to out as the production kernel writes it)."""
    t = tl.program_id(0).to(tl.int64)
    score_row = scores_ptr + t * stride_st
    out_row = out_ptr + t * stride_ot
    scratch_row = scratch_ptr + t * stride_scratch
    if STAGE == 0:
        tl.store(out_row, _read_row(score_row, num_entries, BLOCK, PREFETCH).to(tl.int32, bitcast=True))
        return
    num_groups = (num_entries + GROUP - 1) // GROUP
    if PREFETCH:
        bound = _group_bound_pf(score_row, scratch_row, num_entries, num_groups, k, BLOCK, GROUP, BLOCK_G, BITS)
    else:
        bound = _group_bound(score_row, scratch_row, num_entries, num_groups, k, BLOCK, GROUP, BLOCK_G, BITS)
    if STAGE == 1:
        tl.store(out_row, bound.to(tl.int32, bitcast=True))
        return
    if PREFETCH:
        count = _compact_pf(score_row, scratch_row + BLOCK_G, scratch_row + BLOCK_G + CAND, num_entries, bound,
                            COMPACT, CAND)
    else:
        count = _compact_candidates(score_row, scratch_row + BLOCK_G, scratch_row + BLOCK_G + CAND, num_entries,
                                    bound, COMPACT, CAND)
    if STAGE == 2:
        tl.store(out_row, count)
        return
    # more than CAND candidates would need the full path: the check against production shows it
    _top_k_of_candidates(scratch_row + BLOCK_G, scratch_row + BLOCK_G + CAND, out_row, count, k, BITS, CAND)


def run_stage(pages: DecodePages, out: torch.Tensor, scratch: torch.Tensor, stage: int, prefetch: bool,
              per_thread: int = indexer.COMPACT_PER_THREAD) -> None:
    config = indexer.TOP_K_CONFIG
    entries = pages.scores.shape[1]
    block, warps = _tile_and_warps(entries, config)
    group, block_g, cand = indexer._shortcut_plan(entries, TOPK, config)
    _stage_kernel[(pages.scores.shape[0],)](
        pages.scores, pages.scores.stride(0), out, out.stride(0), scratch, scratch.stride(0), entries, TOPK,
        STAGE=stage, PREFETCH=prefetch, BLOCK=block, GROUP=group, BLOCK_G=block_g, CAND=cand,
        COMPACT=_compact_step(block, warps, per_thread), BITS=config.radix_bits, num_warps=warps)


def probe(batch: int, context: int, compact_per_thread: list[int], no_stages: bool = False) -> None:
    pages = DecodePages(batch, context, 16)
    pages.index_scores()
    entries = pages.scores.shape[1]
    _, block_g, cand = indexer._shortcut_plan(entries, TOPK, indexer.TOP_K_CONFIG)
    scratch = torch.empty(batch, block_g + 2 * cand, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, TOPK, dtype=torch.int32, device="cuda")
    tag = f"bs={batch} ctx={context // 1024}K"
    plain = dataclasses.replace(indexer.TOP_K_CONFIG, group_list=False)
    pages.top_k(plain)
    want = pages.indices.clone()
    print(f"{tag:16s} top_k_indices, whole row {1e3 * do_bench_cudagraph(lambda: pages.top_k(plain)):7.1f} us",
          flush=True)
    listed = dataclasses.replace(indexer.TOP_K_CONFIG, group_list=True)
    pages.top_k(listed)
    check = "indices = the whole row's" if torch.equal(pages.indices, want) else "MISMATCH"
    print(f"{tag:16s} top_k_indices, group_list {1e3 * do_bench_cudagraph(lambda: pages.top_k(listed)):7.1f} us  "
          f"{check}", flush=True)
    for prefetch in () if no_stages else (False, True):
        for stage, name in enumerate(("read the row once", "+ group bound", "+ candidates", "+ top k (= all)")):
            run = lambda: run_stage(pages, out, scratch, stage, prefetch)  # noqa: E731
            run()
            check = ""
            if stage == 3:
                check = "  indices = production's" if torch.equal(out, want) else "  MISMATCH"
            print(f"{tag:16s} {'prefetch' if prefetch else 'as is':8s} {name:18s} "
                  f"{1e3 * do_bench_cudagraph(run):7.1f} us{check}", flush=True)
    for per_thread in compact_per_thread:
        time_compact_step(pages, out, scratch, want, tag, per_thread)


def time_compact_step(pages, out, scratch, want, tag: str, per_thread: int) -> None:
    """The whole path with `per_thread` scores a thread per compaction step (production: 8)."""
    run = lambda: run_stage(pages, out, scratch, 3, False, per_thread)  # noqa: E731
    try:
        run()
    except Exception as exc:  # e.g. a compiler crash at some sizes
        print(f"{tag:16s} compact {per_thread:2d}/thread FAILED {type(exc).__name__}: {str(exc)[:100]}")
        return
    check = "indices = production's" if torch.equal(out, want) else "MISMATCH"
    print(f"{tag:16s} compact {per_thread:2d}/thread   {1e3 * do_bench_cudagraph(run):7.1f} us  {check}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--compact-per-thread", type=int, nargs="*", default=[],
                        help="also the whole path with these scores a thread per compaction step")
    parser.add_argument("--no-stages", action="store_true", help="skip the stage-by-stage timings")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; top-k config {indexer.TOP_K_CONFIG}; rate {CSA_RATE}")
    for context in args.contexts:
        for batch in args.batches:
            probe(batch, context, args.compact_per_thread, args.no_stages)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
