"""Balanced split-KV decode (`DecodeConfig.balance`) against even splits, one layer, on the GPU.

Why: a served ide-completion decode step at 24 running rows takes ~0.6 ms more device time
than the offline profile at the same rows (docs/BENCHMARKS.md), all of it kernel time (the
step trace's device span), while the offline batch has equal contexts (890 + 48) and the
served one mixes file prefixes of ~200 to ~2,500 tokens. Even splits cut each sequence into
the same number of pieces, so the longest context's programs walk several times the keys of
the rest and the launch waits for them; balanced splits cut every sequence into pieces of one
length, so a long context takes more programs.

Cases: N running rows (Qwen3-8B heads: 32 q, 8 KV, head_dim 128, bf16, pages of 16, a 4 GB
pool so pages miss L2), padded as a decode graph pads them (rows of one key) and planned for
its 8,192-key bound; contexts "equal" (every row the ide draw's mean) or "ide" (the workload's
file lengths, Zipf-popular over 48 files and shared, plus a cursor and some decoded tokens).
"mixed C": the same rows as the one-query rows of a mixed graph of C sequences (the rest
prompt rows the varlen kernel owns; here empty), planned for its capacity. Each case: both
plans checked against each other, then timed with do_bench_cudagraph.

    python3 benchmarks/decode_balance_probe.py [--batches 24 32 51 112]
"""
from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.attention.kernels.decode import DecodeConfig, decode_attention  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE, FILES, BOUND = 32, 8, 128, 16, 48, 8192
BLOCK_BYTES = 2 * PAGE * KV_HEADS * DIM * 2
POOL_BLOCKS = (4 << 30) // BLOCK_BYTES   # --pool-gb sets it
RANDOM_PLACEMENT = True                  # --contiguous clears it


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
    free = rng.sample(range(1, POOL_BLOCKS), POOL_BLOCKS - 1) if RANDOM_PLACEMENT else list(range(POOL_BLOCKS - 1, 0, -1))
    shared: dict[int, list[int]] = {}
    table = torch.zeros(rows, BOUND // PAGE, dtype=torch.int32)
    for i, (owner, n) in enumerate(zip(owners, lens)):
        prefix = shared.setdefault(owner, [free.pop() for _ in range(prefix_of.get(owner, 0) // PAGE)])
        row = prefix + [free.pop() for _ in range(-(-n // PAGE) - len(prefix))]
        table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return table.cuda()


def case(cache, n: int, contexts: str, mixed: int | None):
    owners, lens = ide_lengths(n)
    if contexts == "equal":
        lens = [round(sum(lens) / n)] * n
        owners = list(range(n))
    prefix_of = {} if contexts == "equal" else {o: 0 for o in owners}
    if contexts == "ide":  # a file's rows share its prefix (the shortest of its rows' contexts)
        for o, length in zip(owners, lens):
            prefix_of[o] = min(prefix_of[o] or length, length) // PAGE * PAGE
    rows = mixed or -(-n // 8) * 8
    seq_lens = torch.tensor(lens + [1] * (rows - n), dtype=torch.int32, device="cuda")
    starts = list(range(n + 1)) + [n] * (rows - n) if mixed else list(range(rows + 1))
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device="cuda")
    q = torch.randn(starts[-1], HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    table = block_table(owners, lens, prefix_of, rows)
    return q, table, query_start_loc, seq_lens, sum(lens)


def run(cache, q, table, query_start_loc, seq_lens, config, single_only):
    out = torch.empty_like(q)
    decode_attention(q, cache, out, table, query_start_loc, seq_lens, BOUND, DIM ** -0.5, None, 0,
                     config=config, single_only=single_only)
    return out


def main() -> None:
    import triton.testing
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[24, 32, 51, 112])
    parser.add_argument("--pool-gb", type=int, default=4)
    parser.add_argument("--contiguous", action="store_true", help="blocks in order, not drawn at random")
    parser.add_argument("--cases", nargs="+", default=["equal", "ide"])
    parser.add_argument("--no-mixed", action="store_true")
    args = parser.parse_args()
    global POOL_BLOCKS, RANDOM_PLACEMENT
    POOL_BLOCKS, RANDOM_PLACEMENT = (args.pool_gb << 30) // BLOCK_BYTES, not args.contiguous
    torch.manual_seed(0)
    cache = torch.randn(2, POOL_BLOCKS, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    copy = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")
    copy_ms = triton.testing.do_bench_cudagraph(lambda: copy[: 1 << 27].copy_(copy[1 << 27:]))
    gbps = 2 * (1 << 28) / copy_ms / 1e6
    print(f"device: {torch.cuda.get_device_name()}, copy {gbps:,.0f} GB/s; one layer's decode attention; "
          f"pool {args.pool_gb} GB, blocks {'in order' if args.contiguous else 'at random'}")
    even, balanced = DecodeConfig(balance=False), DecodeConfig()
    for n in args.batches:
        for contexts in args.cases:
            for mixed in (None,) if args.no_mixed else (None, 96, 256):
                if mixed is not None and mixed < n:
                    continue
                q, table, qsl, lens, keys = case(cache, n, contexts, mixed)
                single = mixed is not None
                a = run(cache, q, table, qsl, lens, even, single)
                b = run(cache, q, table, qsl, lens, balanced, single)
                err = float((a.float() - b.float()).norm() / a.float().norm())
                t_even = triton.testing.do_bench_cudagraph(lambda: run(cache, q, table, qsl, lens, even, single))
                t_bal = triton.testing.do_bench_cudagraph(lambda: run(cache, q, table, qsl, lens, balanced, single))
                floor_us = keys * KV_HEADS * DIM * 2 * 2 / gbps / 1e3
                where = f"mixed {mixed}" if single else "decode"
                print(f"N {n:4d} {contexts:5s} {where:10s} max {int(lens.max()):5d} keys {keys:6d}  "
                      f"even {t_even * 1e3:7.1f} us  balanced {t_bal * 1e3:7.1f} us  x {t_bal / t_even:4.2f}  "
                      f"floor {floor_us:5.1f} us  rel err {err:.1e}")


if __name__ == "__main__":
    main()
