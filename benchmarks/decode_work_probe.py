"""Work-list decode attention (`kernels/decode_work.py`) against the decode kernel's even
splits, one layer, on the GPU.

Why: served ide-completion decode steps are all device time (the step trace's span), and the
decode kernel at the workload's skewed contexts (files of ~200 to ~2,500 tokens) takes longer
than at equal contexts of the same total keys: even splits cut every sequence into the same
number of pieces, so the longest context's programs walk several times the keys of the rest.

Cases: N running rows (Qwen3-8B heads: 32 q, 8 KV, head_dim 128, bf16, pages of 16, a pool of
--pool-gb with blocks drawn at random), padded as a decode graph pads them (rows of one key)
and planned for its 8,192-key bound; contexts "equal" (every row the ide draw's mean) or "ide"
(the workload's file lengths, Zipf-popular over 48 files and shared, plus a cursor and some
decoded tokens). Each case: both checked against each other, then timed with
do_bench_cudagraph (the list planned and uploaded outside the timing; its host time: --plan-host).

    python3 benchmarks/decode_work_probe.py [--batches 24 32 51 112] [--work-waves 4 8]
    python3 benchmarks/decode_work_probe.py --plan-host --batches 24 51 256   # the host's list per replay, no GPU
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.attention.kernels import decode_work  # noqa: E402
from kvserve.attention.kernels.decode import DecodeConfig, decode_attention  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE, FILES, BOUND = 32, 8, 128, 16, 48, 8192
BLOCK_BYTES = 2 * PAGE * KV_HEADS * DIM * 2
POOL_BLOCKS = (4 << 30) // BLOCK_BYTES   # --pool-gb sets it


def lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    return max(2, int(round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))))


def ide_lengths(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(file of each row, context of each row): the workload's shapes (ide-completion's mean
    input 892, sigma 0.5: files of 0.8 of it, cursors of 0.2) plus 0-127 decoded tokens."""
    rng = random.Random(seed)
    files = [lognormal(rng, 0.8 * 892, 0.5) for _ in range(FILES)]
    owners = rng.choices(range(FILES), [1 / (i + 1) for i in range(FILES)], k=n)
    return owners, [files[o] + lognormal(rng, 0.2 * 892, 0.5) + rng.randint(0, 127) for o in owners]


def block_table(owners: list[int], lens: list[int], prefix_of: dict[int, int], rows: int) -> torch.Tensor:
    """Random pool blocks; a file's prefix blocks shared by its rows; padding rows block 0."""
    rng = random.Random(len(lens))
    free = rng.sample(range(1, POOL_BLOCKS), POOL_BLOCKS - 1)
    shared: dict[int, list[int]] = {}
    table = torch.zeros(rows, BOUND // PAGE, dtype=torch.int32)
    for i, (owner, n) in enumerate(zip(owners, lens)):
        prefix = shared.setdefault(owner, [free.pop() for _ in range(prefix_of.get(owner, 0) // PAGE)])
        row = prefix + [free.pop() for _ in range(-(-n // PAGE) - len(prefix))]
        table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return table.cuda()


def case(n: int, contexts: str):
    owners, lens = ide_lengths(n)
    if contexts == "equal":
        lens = [round(sum(lens) / n)] * n
        owners = list(range(n))
    prefix_of = {}
    if contexts == "ide":  # a file's rows share its prefix (the shortest of its rows' contexts)
        for o, length in zip(owners, lens):
            prefix_of[o] = min(prefix_of.get(o) or length, length) // PAGE * PAGE
    rows = -(-n // 8) * 8   # a decode graph's padded size
    host_lens = np.array(lens + [1] * (rows - n))
    seq_lens = torch.tensor(host_lens, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    return q, block_table(owners, lens, prefix_of, rows), query_start_loc, seq_lens, host_lens, sum(lens)


def graph_rows(n: int) -> tuple[int, np.ndarray]:
    """The decode graph's size for n running rows and its rows' keys (the workload's contexts;
    padding rows 1 key)."""
    size = -(-n // 8) * 8
    return size, np.array(ide_lengths(n)[1] + [1] * (size - n))


def decode_streak(lists, keys: np.ndarray, size: int, steps: int = 128) -> None:
    """`lists.write` as a decode streak's replays call it: every row one key longer a step."""
    for step in range(steps):
        lists.write(keys + step, size)


def plan_host(batches: list[int], repeats: int = 200) -> None:
    """What a decode graph's replay adds on the host (`WorkLists.write`: `plan_work` and the
    buffer's rewrite), at the workload's contexts, on this machine's device (a CPU one here)."""
    from kvserve.runner.cuda_graph import WorkLists
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for n in batches:
        size, keys = graph_rows(n)
        lists = WorkLists(KV_HEADS, 132, size, device)
        cap = lists.capacity(size)
        timings = []
        flipped = np.where(np.arange(size) % 2 == 0, keys, 0)   # other split counts: each write rewrites
        for fn in (lambda: decode_work.plan_work(keys, KV_HEADS, 132, cap),
                   lambda: (lists.write(keys, size), lists.write(flipped, size)),
                   lambda: decode_streak(lists, keys, size)):
            fn()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            timings.append((time.perf_counter() - t0) / repeats * 1e6)
        print(f"N {n:4d} (graph {size}, 132 SMs)  plan_work {timings[0]:6.1f} us  plan + buffer write {timings[1] / 2:6.1f} us  "
              f"a write in a 128-step decode streak {timings[2] / 128:6.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[24, 32, 51, 112])
    parser.add_argument("--pool-gb", type=int, default=4)
    parser.add_argument("--cases", nargs="+", default=["equal", "ide"])
    parser.add_argument("--plan-host", action="store_true")
    parser.add_argument("--work-waves", type=int, nargs="+", default=[DecodeConfig().waves],
                        help="plan the work list for each of these waves (DecodeConfig.waves; default the engine's)")
    args = parser.parse_args()
    if args.plan_host:
        return plan_host(args.batches)
    import triton.testing
    global POOL_BLOCKS
    POOL_BLOCKS = (args.pool_gb << 30) // BLOCK_BYTES
    torch.manual_seed(0)
    cache = torch.randn(2, POOL_BLOCKS, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    copy = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")
    copy_ms = triton.testing.do_bench_cudagraph(lambda: copy[: 1 << 27].copy_(copy[1 << 27:]))
    gbps = 2 * (1 << 28) / copy_ms / 1e6
    print(f"device: {torch.cuda.get_device_name()}, copy {gbps:,.0f} GB/s; one layer's decode attention; "
          f"pool {args.pool_gb} GB, blocks at random")
    for n in args.batches:
        for contexts in args.cases:
            time_case(n, contexts, cache, gbps, args.work_waves)


def time_case(n: int, contexts: str, cache: torch.Tensor, gbps: float, waves: list[int]) -> None:
    """Even splits, then the work list planned for each `waves` (programs a KV head: waves x SMs
    over the KV heads), on one batch; a line each list."""
    import triton.testing
    q, table, qsl, lens, host_lens, keys = case(n, contexts)

    def even():
        return decode_attention(q, cache, torch.empty_like(q), table, qsl, lens, BOUND, DIM ** -0.5, None, 0)
    expected = even().float()
    t_even = triton.testing.do_bench_cudagraph(even)
    floor_us = keys * KV_HEADS * DIM * 2 * 2 / gbps / 1e3
    for w in waves:
        config = DecodeConfig(waves=w)
        work = decode_work.device_work(host_lens, KV_HEADS, "cuda", config)

        def listed():
            return decode_work.work_decode_attention(q, cache, torch.empty_like(q), table, qsl, lens,
                                                     DIM ** -0.5, work, config)
        err = float((listed().float() - expected).norm() / expected.norm())
        t_work = triton.testing.do_bench_cudagraph(listed)
        print(f"N {n:4d} {contexts:5s} max {int(host_lens.max()):5d} keys {keys:6d}  "
              f"even {t_even * 1e3:7.1f} us  work list (waves {w}) {t_work * 1e3:7.1f} us  x {t_work / t_even:4.2f}  "
              f"floor {floor_us:5.1f} us  items {int(work.seq_splits.sum())} (max {int(work.seq_splits.max())} "
              f"a row)  rel err {err:.1e}")

if __name__ == "__main__":
    main()
