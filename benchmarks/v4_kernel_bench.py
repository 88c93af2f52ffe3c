"""DeepSeek V4 Triton kernels on one GPU at V4-Flash attention shapes (64 heads x
512, one K=V head; indexer 64 heads x 128, top-512; window 128; CSA rate 4,
HCA rate 128; bf16 pages), against the device's measured copy bandwidth.

    python benchmarks/v4_kernel_bench.py [--batches 1 64 256] [--contexts 4096 32768 131072]
                                         [--block-size 16] [--no-sweeps]

Prints, after the copy bandwidth (a torch copy of 4 GiB: bytes read + written
per second, kvserve.bench.kernels):
  * CSA decode (one token per sequence at `context`): index scores, top-k and
    sparse attention, each and in sum, and GB/s over the bytes a CSA decode
    must read (every visible indexer key, the 512 chosen entries, the 128
    window keys) as a share of the copy bandwidth;
  * HCA decode attention (window + every visible entry) and its GB/s;
  * sweeps: split count and tile shape of the attention, at 32K;
  * the compressor at decode (every token closing a window) and over an
    8,192-token prefill chunk, and the indexer over that chunk.
Timings: triton.testing.do_bench medians (L2 flushed between runs). The pages
hold one layer of each kind in blocks sized for the largest page of the run
(batch 256 x 128K: 38 GB), as the engine's storage would hold them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.bench.kernels import copy_bandwidth_gbs  # noqa: E402
from kvserve.cache.v4_specs import V4KVLayout  # noqa: E402
from kvserve.model.deepseek_v4 import kernels  # noqa: E402
from kvserve.model.deepseek_v4.kernels import PageRef, SparseAttentionConfig, V4PagedBatch  # noqa: E402

D, DI, H, HI, TOPK, WINDOW, CSA_RATE, HCA_RATE, ROPE = 512, 128, 64, 64, 512, 128, 4, 128, 64
DTYPE, DEVICE, ELEM = torch.bfloat16, "cuda", 2


def _ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def _ids(count: int) -> torch.Tensor:
    """Block ids 1..count in random order (pages of one sequence are scattered)."""
    return (torch.randperm(count, device=DEVICE) + 1).to(torch.int32)


class DecodePages:
    """One decode token per sequence at position context - 1: the sliding,
    CSA-entry and HCA-entry pages of one layer each, and their tables."""

    def __init__(self, batch: int, context: int, block_size: int) -> None:
        B, slots = block_size, triton.cdiv(context, block_size)
        first_window_slot = max(0, context - WINDOW) // B
        hca_slots = [i for i in range(slots) if (i + 1) * B // HCA_RATE > i * B // HCA_RATE]
        per_seq = (slots - first_window_slot) + slots + len(hca_slots)
        self.storage = torch.empty(1 + batch * per_seq, B * D, dtype=DTYPE, device=DEVICE).normal_()
        ids = _ids(batch * per_seq).view(batch, per_seq)
        sliding = torch.zeros(batch, slots, dtype=torch.int32, device=DEVICE)
        sliding[:, first_window_slot:] = ids[:, :slots - first_window_slot]
        csa = ids[:, slots - first_window_slot:2 * slots - first_window_slot].contiguous()
        hca = torch.zeros(batch, slots, dtype=torch.int32, device=DEVICE)
        hca[:, hca_slots] = ids[:, 2 * slots - first_window_slot:]
        positions = torch.full((batch,), context - 1, dtype=torch.int64, device=DEVICE)
        seq_idx = torch.arange(batch, dtype=torch.int32, device=DEVICE)
        self.batch = V4PagedBatch(self.storage, V4KVLayout(B, B * D, ()), [sliding, csa, hca], seq_idx, positions,
                                  context)
        self.sliding = PageRef(sliding, 0, B, D)
        self.csa = PageRef(csa, 0, B // CSA_RATE, D + DI)
        self.hca = PageRef(hca, 0, max(1, B // HCA_RATE), D)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        self.q = torch.randn(batch, H, D, generator=g, device=DEVICE, dtype=DTYPE) * (8 / D) ** 0.5
        self.q_index = torch.randn(batch, HI, DI, generator=g, device=DEVICE, dtype=DTYPE)
        self.weights = torch.randn(batch, HI, generator=g, device=DEVICE) * HI ** -0.5
        self.sinks = torch.randn(H, generator=g, device=DEVICE)
        self.scores = torch.empty(batch, context // CSA_RATE, dtype=torch.float32, device=DEVICE)
        self.indices = torch.empty(batch, TOPK, dtype=torch.int32, device=DEVICE)
        self.out = torch.empty_like(self.q)

    def index_scores(self) -> None:
        kernels.index_scores(self.q_index, self.weights, self.csa, D, self.batch, CSA_RATE, self.scores)

    def top_k(self) -> None:
        kernels.top_k_indices(self.scores, self.batch, CSA_RATE, TOPK, self.indices)

    def attend(self, kind: str, config: SparseAttentionConfig = SparseAttentionConfig()) -> None:
        entries, indices, rate = (self.csa, self.indices, CSA_RATE) if kind == "csa" else (self.hca, None, HCA_RATE)
        kernels.sparse_attention(self.q, self.sliding, entries, indices, self.sinks, D ** -0.5, WINDOW, rate,
                                 self.batch, self.out, config)

    def csa_step(self) -> None:
        self.index_scores()
        self.top_k()
        self.attend("csa")


def csa_bytes(batch: int, context: int, with_indexer: bool = True) -> int:
    entries = context // CSA_RATE
    keys = entries * DI if with_indexer else 0
    return batch * ELEM * (keys + (min(entries, TOPK) + min(context, WINDOW)) * D)


def hca_bytes(batch: int, context: int) -> int:
    return batch * ELEM * (context // HCA_RATE + min(context, WINDOW)) * D


def _rate(nbytes: int, ms: float, copy_gbs: float) -> str:
    gbs = nbytes / ms / 1e6
    return f"{gbs:8.0f} GB/s {100 * gbs / copy_gbs:6.1f}% of copy"


def bench_decode(batch: int, context: int, block_size: int, copy_gbs: float) -> DecodePages:
    pages = DecodePages(batch, context, block_size)
    pages.csa_step()  # indices for the attention-only timing
    scores, top_k = _ms(pages.index_scores), _ms(pages.top_k)
    attend, total = _ms(lambda: pages.attend("csa")), _ms(pages.csa_step)
    tag = f"bs={batch:4d} ctx={context:7d} B={block_size}"
    print(f"CSA decode {tag}  scores {1e3 * scores:8.1f} us  top-k {1e3 * top_k:7.1f} us  "
          f"attn {1e3 * attend:7.1f} us  total {1e3 * total:8.1f} us  {_rate(csa_bytes(batch, context), total, copy_gbs)}")
    print(f"    scores alone {_rate(batch * ELEM * (context // CSA_RATE) * DI, scores, copy_gbs)};  "
          f"attention alone {_rate(csa_bytes(batch, context, False), attend, copy_gbs)}")
    hca = _ms(lambda: pages.attend("hca"))
    print(f"HCA decode {tag}  attn {1e3 * hca:8.1f} us  {_rate(hca_bytes(batch, context), hca, copy_gbs)}")
    return pages


def sweep_attention(pages: DecodePages, batch: int, context: int, copy_gbs: float) -> None:
    configs = [SparseAttentionConfig(num_splits=n) for n in (1, 2, 4, 8)] + [
        SparseAttentionConfig(block_n=16, num_stages=3), SparseAttentionConfig(block_n=64),
        SparseAttentionConfig(num_stages=3)]
    for config in configs:
        ms = _ms(lambda: pages.attend("csa", config))
        print(f"  sweep CSA attn bs={batch} ctx={context} n={config.block_n} warps={config.num_warps} "
              f"stages={config.num_stages} splits={config.num_splits}  {1e3 * ms:8.1f} us  "
              f"{_rate(csa_bytes(batch, context, False), ms, copy_gbs)}")


class CompressPages:
    """State and entry pages for tokens at `positions` of `batch` sequences (one
    sequence per token), every state row of their windows filled."""

    def __init__(self, seq_positions: list[torch.Tensor], block_size: int) -> None:
        B = block_size
        width = 4 * D + 4 * DI
        slots = triton.cdiv(int(max(p.max() for p in seq_positions)) + 1, B)
        n = len(seq_positions)
        self.storage = torch.empty(1 + 4 * n * slots, B * width, dtype=DTYPE, device=DEVICE).normal_()
        ids = _ids(4 * n * slots).view(4, n, slots)
        seq_idx = torch.cat([torch.full((len(p),), i, dtype=torch.int32) for i, p in enumerate(seq_positions)])
        positions = torch.cat(seq_positions)
        self.batch = V4PagedBatch(self.storage, V4KVLayout(B, B * width, ()), list(ids), seq_idx.to(DEVICE),
                                  positions.to(DEVICE), int(positions.max()) + 1)
        self.csa_state, self.csa_entries = PageRef(ids[0], 0, B, width), PageRef(ids[1], 0, B // CSA_RATE, D + DI)
        self.hca_state, self.hca_entries = PageRef(ids[2], 0, B, 2 * D), PageRef(ids[3], 0, 1, D)
        g = torch.Generator(device=DEVICE).manual_seed(1)
        self.ape = {r: torch.randn(r, w, generator=g, device=DEVICE) for r, w in ((CSA_RATE, 2 * D), (HCA_RATE, D))}
        self.ape_index = torch.randn(CSA_RATE, 2 * DI, generator=g, device=DEVICE)
        self.norm = torch.ones(D, device=DEVICE)
        self.norm_index = torch.ones(DI, device=DEVICE)
        t = len(positions)
        self.cos = torch.rand(t, ROPE // 2, generator=g, device=DEVICE).to(DTYPE)
        self.sin = torch.rand(t, ROPE // 2, generator=g, device=DEVICE).to(DTYPE)

    def csa(self) -> None:
        args = (self.csa_state, self.csa_entries, self.batch)
        kernels.compress(*args, (0, 2 * D, 0), CSA_RATE, True, self.ape[CSA_RATE], self.norm, 1e-6, self.cos,
                         self.sin)
        kernels.compress(*args, (4 * D, 4 * D + 2 * DI, D), CSA_RATE, True, self.ape_index, self.norm_index, 1e-6,
                         self.cos, self.sin)

    def hca(self) -> None:
        kernels.compress(self.hca_state, self.hca_entries, self.batch, (0, D, 0), HCA_RATE, False,
                         self.ape[HCA_RATE], self.norm, 1e-6, self.cos, self.sin)


def bench_compressor(batch: int, block_size: int, copy_gbs: float) -> None:
    """Decode: every token closes a CSA and an HCA window (position 128k - 1)."""
    pages = CompressPages([torch.tensor([HCA_RATE * (8 + i % 8) - 1]) for i in range(batch)], block_size)
    csa, hca = _ms(pages.csa), _ms(pages.hca)
    csa_read = batch * ELEM * 2 * CSA_RATE * 2 * (D + DI)  # 2 x rate rows of kv + gate, half of each row
    hca_read = batch * ELEM * HCA_RATE * 2 * D
    print(f"compress decode bs={batch:4d} B={block_size}  CSA (entry + indexer key) {1e3 * csa:7.1f} us "
          f"{_rate(csa_read, csa, copy_gbs)}  HCA {1e3 * hca:7.1f} us {_rate(hca_read, hca, copy_gbs)}")


def bench_prefill_chunk(chunk: int, context: int, block_size: int, copy_gbs: float) -> None:
    """One sequence's chunk of `chunk` tokens ending at `context`: compressors over
    it (every window it closes) and the indexer (scores + top-k) of its queries."""
    pages = CompressPages([torch.arange(context - chunk, context)], block_size)
    csa, hca = _ms(pages.csa), _ms(pages.hca)
    print(f"compress prefill chunk={chunk} ctx={context} B={block_size}  CSA {1e3 * csa:8.1f} us  "
          f"HCA {1e3 * hca:8.1f} us")
    del pages
    decode = DecodePages(1, context, block_size)
    positions = torch.arange(context - chunk, context, device=DEVICE)
    batch = V4PagedBatch(decode.storage, decode.batch.layout, decode.batch.block_tables,
                         torch.zeros(chunk, dtype=torch.int32, device=DEVICE), positions, context)
    g = torch.Generator(device=DEVICE).manual_seed(2)
    q = torch.randn(chunk, HI, DI, generator=g, device=DEVICE, dtype=DTYPE)
    weights = torch.randn(chunk, HI, generator=g, device=DEVICE) * HI ** -0.5
    scores = torch.empty(chunk, context // CSA_RATE, dtype=torch.float32, device=DEVICE)
    out = torch.empty(chunk, TOPK, dtype=torch.int32, device=DEVICE)
    score_ms = _ms(lambda: kernels.index_scores(q, weights, decode.csa, D, batch, CSA_RATE, scores))
    top_k_ms = _ms(lambda: kernels.top_k_indices(scores, batch, CSA_RATE, TOPK, out))
    flops = 2 * HI * DI * int(((positions + 1) // CSA_RATE).sum())
    print(f"indexer prefill chunk={chunk} ctx={context}  scores {1e3 * score_ms:8.1f} us "
          f"({flops / score_ms / 1e9:6.1f} TFLOP/s)  top-k {1e3 * top_k_ms:8.1f} us")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-sweeps", action="store_true")
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--prefill-context", type=int, default=32768)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}\ncopy bandwidth (D2D, read+write): {copy_gbs:.0f} GB/s")
    for context in args.contexts:
        for batch in args.batches:
            pages = bench_decode(batch, context, args.block_size, copy_gbs)
            if not args.no_sweeps and context == 32768 and batch in (1, 64):
                sweep_attention(pages, batch, context, copy_gbs)
            del pages
            torch.cuda.empty_cache()
    for batch in (64, 256):
        bench_compressor(batch, args.block_size, copy_gbs)
    bench_prefill_chunk(args.prefill_chunk, args.prefill_context, args.block_size, copy_gbs)


if __name__ == "__main__":
    main()
