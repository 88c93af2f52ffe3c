"""Shared-prefix (cascade) decode attention against the decode kernel at served ide-completion
shapes, one layer, on the GPU (`kvserve/attention/kernels/cascade.py`).

Why: served ide-completion decode steps cost ~50 us a running sequence past the batch-1 step
(`python -m kvserve.engine.step_trace`, docs/BENCHMARKS.md), where each sequence's ~950 keys
are ~29 us of KV at copy bandwidth; the offline profile with three sequences a prefix (L2
sharing) read ~24 us. Running requests share 48 file prefixes of ~700 tokens (Zipf-popular);
cascade attention reads each shared prefix once a step.

Cases: N sequences, Qwen3-8B heads (32 q, 8 KV, head_dim 128), bf16, pages of 16, a 704-token
file prefix each (owners drawn Zipf over 48 files with the workload's seed, or a fixed count a
prefix) plus 150-450 keys of their own; the cache 4 GB so pages miss L2 as in a served pool.
Each case: both kernels checked against each other (relative error), then timed with
do_bench_cudagraph (the plan is built outside the timing; its host time is printed apart).

    python3 benchmarks/cascade_decode_probe.py [--batches 24 51 112] [--prefix-splits 2 4 8]
    python3 benchmarks/cascade_decode_probe.py --plan-host --batches 24 51 256   # the host's grouping, no GPU
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.attention.kernels import cascade  # noqa: E402
from kvserve.attention.kernels.decode import decode_attention  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE, PREFIX, FILES = 32, 8, 128, 16, 704, 48
POOL_BLOCKS = (4 << 30) // (2 * PAGE * KV_HEADS * DIM * 2)   # a 4 GB pool


def owners_for(n: int, sharing: str, seed: int = 0) -> list[int]:
    """File of each sequence: "zipf" (the workload's popularity over 48 files) or "k" a file each."""
    if sharing == "zipf":
        rng = random.Random(seed)
        weights = [1 / (i + 1) for i in range(FILES)]
        return rng.choices(range(FILES), weights, k=n)
    return [i // int(sharing) for i in range(n)]


def make_batch(n: int, sharing: str, device: str = "cuda"):
    """Block tables over a random pool: a file's prefix blocks shared by its sequences, each
    sequence's own blocks after them; blocks drawn at random so neighbours are not contiguous."""
    rng = random.Random(n)
    free = rng.sample(range(1, POOL_BLOCKS), POOL_BLOCKS - 1)
    files: dict[int, list[int]] = {}
    rows, lens = [], []
    for owner in owners_for(n, sharing):
        prefix = files.setdefault(owner, [free.pop() for _ in range(PREFIX // PAGE)])
        own = rng.randint(150, 450)
        rows.append(prefix + [free.pop() for _ in range(-(-own // PAGE))])
        lens.append(PREFIX + own)
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)
    return rows, lens, table


def run_case(cache, n: int, sharing: str, prefix_splits: int) -> None:
    from triton.testing import do_bench_cudagraph
    rows, lens, table = make_batch(n, sharing)
    q = torch.randn(n, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    start = time.perf_counter()
    plan = cascade.build_plan(rows, lens, PAGE, "cuda")
    plan_us = (time.perf_counter() - start) * 1e6
    scale, plain_out, out = DIM ** -0.5, torch.empty_like(q), torch.empty_like(q)
    plain = lambda: decode_attention(q, cache, plain_out, table, qsl, seq_lens, max(lens), scale, None, 0)  # noqa: E731
    casc = lambda: cascade.cascade_decode_attention(q, cache, out, table, qsl, seq_lens, max(lens), scale,  # noqa: E731
                                                    plan, prefix_splits=prefix_splits)
    plain(), casc()
    err = ((out.float() - plain_out.float()).norm() / plain_out.float().norm()).item()
    t_plain, t_casc = do_bench_cudagraph(plain, rep=50) * 1e3, do_bench_cudagraph(casc, rep=50) * 1e3
    keys = sum(lens)
    unique = len({b for r in rows for b in r}) * PAGE   # keys in distinct blocks
    print(f"N {n:4d} {sharing:>5} groups {plan.num_groups:3d} psplits {prefix_splits}  plain {t_plain:7.1f} us  "
          f"cascade {t_casc:7.1f} us  x{t_casc / t_plain:5.2f}  keys {keys} unique ~{unique}  "
          f"plan {plan_us:6.0f} us host  rel err {err:.1e}", flush=True)


def plan_host(batches: list[int]) -> None:
    """The host's grouping per step (`plan_groups` on the host block table) and a graph's buffer
    rewrite, median of 50, Zipf owners; no GPU needed."""
    import statistics
    for n in batches:
        _, lens, table = make_batch(n, "zipf", "cpu")
        table, lens = table.numpy(), torch.tensor(lens).numpy()
        buffers = cascade.CascadeBuffers(n, cascade.MAX_GRAPH_GROUPS, table.shape[1], "cpu")
        group_us, write_us = [], []
        for _ in range(50):
            start = time.perf_counter()
            groups = cascade.plan_groups(table, lens, PAGE)
            mid = time.perf_counter()
            buffers.write(groups, table, n, PAGE)
            group_us.append((mid - start) * 1e6)
            write_us.append((time.perf_counter() - mid) * 1e6)
        print(f"N {n:4d}  groups {len(groups):3d} ({sum(len(m) for m, _ in groups)} sequences)  "
              f"plan_groups {statistics.median(group_us):6.0f} us  buffer write {statistics.median(write_us):5.0f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[24, 51, 112])
    p.add_argument("--sharing", nargs="+", default=["zipf", "1", "3", "16"])
    p.add_argument("--prefix-splits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--plan-host", action="store_true", help="time the host's grouping only (no GPU)")
    a = p.parse_args()
    if a.plan_host:
        return plan_host(a.batches)
    cache = torch.randn(2, POOL_BLOCKS, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    print(f"device: {torch.cuda.get_device_name()}, pool {cache.numel() * 2 >> 20} MB; one layer's attention")
    for n in a.batches:
        for sharing in a.sharing:
            for splits in a.prefix_splits:
                run_case(cache, n, sharing, splits)


if __name__ == "__main__":
    main()
