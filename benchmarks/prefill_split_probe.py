"""The varlen kernel at a short chunk beside decodes, as a mixed CUDA graph launches it: the
split count planned for the graph's context bound, against splits sized by each query tile's
own keys (`PrefillConfig.tile_split_keys`).

One layer of Qwen3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128, bf16,
16-token pages): `--decodes` one-query rows (left to the decode kernel, so idle here) and one
prompt chunk of S new tokens after P cached ones, in the tile table of the graph bucket that
holds them, with `max_seq_len` the bound (`--bound`, a server's max_model_len). Each variant's
launch is captured in a CUDA graph 20 times over and replayed; it prints microseconds a launch
(the kernel and its reduce, median of `--reps` replays) and the largest difference from the
first variant's output on the chunk's rows.

    python3 benchmarks/prefill_split_probe.py --chunks 16 32 212 --prefix 688 --keys 0 128 256 512 1024
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kvserve.attention.kernels.prefill import PrefillConfig, prefill_attention, tile_table
from kvserve.attention.metadata import PrefillTiles
from kvserve.runner.mixed_graph import token_buckets

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
LAUNCHES = 20


def scenario(decodes: int, chunk: int, prefix: int, decode_ctx: int, device: torch.device):
    """(q, kv_cache, table, query_start_loc, seq_lens, tiles, chunk rows) of one step."""
    lens = [1] * decodes + [chunk]
    ctx = [decode_ctx] * decodes + [prefix + chunk]
    width = -(-max(ctx) // PAGE)
    blocks = len(lens) * width + 1
    kv_cache = torch.randn(2, blocks, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    table = (torch.randperm(blocks - 1, device=device)[:len(lens) * width] + 1).view(len(lens), width).int()
    q = torch.randn(sum(lens), HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    query_lens = torch.tensor(lens, dtype=torch.int32)
    block_q = PrefillConfig().block_q(HEADS, KV_HEADS)
    seq, q_tile = tile_table(query_lens, block_q, skip_single=True)
    bucket = next(b for b in token_buckets(8192) if b >= sum(lens))
    capacity = -(-bucket // block_q) + min(bucket, 8)
    tile_seq = torch.full((capacity,), -1, dtype=torch.int32)
    tile_q = torch.zeros(capacity, dtype=torch.int32)
    tile_seq[:len(seq)], tile_q[:len(q_tile)] = seq, q_tile
    tiles = PrefillTiles(tile_seq.to(device), tile_q.to(device))
    return (q, kv_cache, table, starts.to(device), torch.tensor(ctx, dtype=torch.int32, device=device),
            tiles, slice(decodes, decodes + chunk), bucket, capacity)


def time_variant(args: tuple, config: PrefillConfig, bound: int, reps: int) -> tuple[float, torch.Tensor]:
    q, kv_cache, table, starts, seq_lens, tiles, rows = args[:7]
    out = torch.zeros_like(q)

    def launch() -> None:
        prefill_attention(q, kv_cache, out, table, starts, seq_lens, q.shape[0], HEAD_DIM ** -0.5, None, 0,
                          config=config, tiles=tiles, single_queries=False, max_seq_len=bound)
    launch()   # compile
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(LAUNCHES):
            launch()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / LAUNCHES)
    return statistics.median(times), out[rows].float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 212])
    p.add_argument("--prefix", type=int, default=688)
    p.add_argument("--decodes", type=int, default=48)
    p.add_argument("--decode-ctx", type=int, default=1024)
    p.add_argument("--bound", type=int, default=8192)
    p.add_argument("--keys", type=int, nargs="+", default=[0, 128, 256, 512, 1024])
    p.add_argument("--splits", type=int, nargs="*", default=[], help="also fixed split counts (no tile sizing)")
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    variants = [(f"tile_split_keys={k}", PrefillConfig(tile_split_keys=k)) for k in a.keys]
    variants += [(f"num_splits={n}", PrefillConfig(num_splits=n, tile_split_keys=0)) for n in a.splits]
    for chunk in a.chunks:
        args = scenario(a.decodes, chunk, a.prefix, a.decode_ctx, device)
        print(f"chunk {chunk} after {a.prefix} beside {a.decodes} decodes: bucket {args[7]} tokens, "
              f"{args[8]} tile entries, bound {a.bound}, planned splits "
              f"{PrefillConfig().plan_splits(args[0].shape[0], HEADS, KV_HEADS, HEAD_DIM, a.bound, 132)}")
        first = None
        for label, config in variants:
            us, out = time_variant(args, config, a.bound, a.reps)
            first = out if first is None else first
            diff = float((out - first).abs().max())
            print(f"  {label:22s} {us:8.2f} us a launch   max |diff| {diff:.4f}")


if __name__ == "__main__":
    main()
