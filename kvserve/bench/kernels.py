"""Attention-kernel micro-benchmark against the device's own ceilings.

`python -m kvserve.bench.kernels` measures the copy bandwidth (a large
device-to-device copy, bytes read + written), then decode attention GB/s and
its fraction of that bandwidth (batch 64, Qwen3-8B heads: 32 q / 8 kv,
head_dim 128, bf16, contexts 4K/16K/64K, block sizes 16/64), a few decode
kernel variants, and prefill TFLOP/s against torch SDPA (flash) on the same
problem in contiguous tensors (`--prefill-only`: every prefill variant at
the shapes of a served 8K-token step). Timings are triton.testing.do_bench medians;
every working set is larger than L2 (do_bench also flushes L2 between runs).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kvserve.attention.kernels import (DecodeConfig, PrefillConfig,
                                       decode_attention, prefill_attention)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
DECODE_VARIANTS = [DecodeConfig(),
                   DecodeConfig.uniform(64, 4, 3),
                   DecodeConfig.uniform(32, 4, 4),
                   DecodeConfig.uniform(128, 4, 3),
                   DecodeConfig.uniform(64, 8, 4),
                   DecodeConfig(num_splits=1),
                   DecodeConfig(num_splits=8)]
PREFILL_VARIANTS = [PrefillConfig(),
                    PrefillConfig(unmasked_before=False),   # every tile masked: the kernel before
                    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
                    PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
                    PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=2),
                    PrefillConfig(block_m=256, block_n=64, num_warps=8, num_stages=3),
                    PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
                    PrefillConfig(block_m=128, block_n=32, num_warps=8, num_stages=4)]
# The shapes of a served prefill step of 8K tokens: fresh prompts, and a long prompt's later chunks.
PREFILL_SHAPES = [(8, 1024, 0), (2, 4096, 4096), (1, 8192, 0)]


def _median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth_gbs(num_bytes: int = 4 << 30) -> float:
    src = torch.randn(num_bytes // 2, dtype=DTYPE, device=DEVICE)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / ms / 1e6


class PagedBatch:
    """A random paged cache holding `batch` sequences of `max_context` keys."""

    def __init__(self, batch: int, max_context: int, block_size: int):
        blocks_per_seq = max_context // block_size
        num_blocks = 1 + batch * blocks_per_seq
        self.kv_cache = torch.randn(2, num_blocks, block_size, KV_HEADS, HEAD_DIM,
                                    dtype=DTYPE, device=DEVICE)
        ids = torch.randperm(num_blocks - 1, device=DEVICE) + 1
        self.block_table = ids.view(batch, blocks_per_seq).to(torch.int32)
        self.batch = batch

    def decode(self, context: int, config: DecodeConfig, window: int | None = None):
        """A closure running one decode step of every sequence at `context`."""
        q = torch.randn(self.batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        out = torch.empty_like(q)
        starts = torch.arange(self.batch + 1, dtype=torch.int32, device=DEVICE)
        seq_lens = torch.full((self.batch,), context, dtype=torch.int32, device=DEVICE)
        return lambda: decode_attention(q, self.kv_cache, out, self.block_table, starts,
                                        seq_lens, context, HEAD_DIM ** -0.5, window, 0,
                                        config)


def decode_bytes(batch: int, keys: int) -> int:
    kv = 2 * batch * keys * KV_HEADS * HEAD_DIM * 2
    return kv + 2 * batch * HEADS * HEAD_DIM * 2


def bench_decode(copy_gbs: float, batch: int, contexts: list[int]) -> list[str]:
    rows = []
    for block_size in (16, 64):
        paged = PagedBatch(batch, max(contexts), block_size)
        for context in contexts:
            ms = _median_ms(paged.decode(context, DecodeConfig()))
            gbs = decode_bytes(batch, context) / ms / 1e6
            rows.append(f"decode  bs={block_size:<3} ctx={context:>6}  {ms * 1e3:9.1f} us"
                        f"  {gbs:7.0f} GB/s  {gbs / copy_gbs:6.1%} of copy")
        window = 4096
        ms = _median_ms(paged.decode(max(contexts), DecodeConfig(), window=window))
        gbs = decode_bytes(batch, min(window, max(contexts))) / ms / 1e6
        rows.append(f"decode  bs={block_size:<3} ctx={max(contexts):>6} window={window}"
                    f"  {ms * 1e3:9.1f} us  {gbs:7.0f} GB/s (window bytes)")
        rows += _decode_variants(paged, copy_gbs, batch, block_size,
                                 min(16384, max(contexts)))
        del paged
        torch.cuda.empty_cache()
    return rows


def _decode_variants(paged: PagedBatch, copy_gbs: float, batch: int,
                     block_size: int, context: int) -> list[str]:
    rows = []
    for config in DECODE_VARIANTS:
        ms = _median_ms(paged.decode(context, config))
        gbs = decode_bytes(batch, context) / ms / 1e6
        n, w, st = config.tile(2)
        rows.append(f"  variant bs={block_size} ctx={context} split tile n={n} "
                    f"w={w} st={st} splits={config.num_splits}"
                    f"  {ms * 1e3:8.1f} us  {gbs / copy_gbs:6.1%}")
    return rows


def paged_cache(k: torch.Tensor, v: torch.Tensor, batch: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v: [batch * keys, KV_HEADS, HEAD_DIM], `batch` sequences of equal length, scattered
    over random blocks of a paged cache (block 0, the NULL block, left unwritten and unread):
    (kv_cache [2, blocks + 1, block_size, KV_HEADS, HEAD_DIM], block table [batch, blocks a sequence])."""
    num_blocks = k.shape[0] // block_size
    ids = torch.randperm(num_blocks, device=k.device) + 1
    kv_cache = torch.empty(2, num_blocks + 1, block_size, KV_HEADS, HEAD_DIM, dtype=k.dtype, device=k.device)
    kv_cache[0, ids] = k.view(num_blocks, block_size, KV_HEADS, HEAD_DIM)
    kv_cache[1, ids] = v.view(num_blocks, block_size, KV_HEADS, HEAD_DIM)
    return kv_cache, ids.view(batch, -1).to(torch.int32)


def bench_prefill(batch: int, seq_len: int, block_size: int, prefix: int = 0,
                  variants: list[PrefillConfig] = PREFILL_VARIANTS) -> list[str]:
    """`batch` chunks of `seq_len` new tokens, each after `prefix` cached
    ones (chunked prefill of a long prompt); SDPA's row only without a prefix."""
    total = prefix + seq_len
    q = torch.randn(batch * seq_len, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    k, v = torch.randn(2, batch * total, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    kv_cache, table = paged_cache(k, v, batch, block_size)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * seq_len
    seq_lens = torch.full((batch,), total, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    # causal: each new token scores its prefix and the chunk's keys up to itself
    flops = 4 * batch * HEADS * HEAD_DIM * (seq_len * prefix + seq_len * seq_len // 2)
    rows = []
    for config in variants:
        label = (f"prefill {batch}x{seq_len} after {prefix} bs={block_size} m={config.block_m} "
                 f"n={config.block_n} w={config.num_warps} st={config.num_stages}"
                 f"{'' if config.unmasked_before else ' all-masked'}")
        try:
            ms = _median_ms(lambda: prefill_attention(
                q, kv_cache, out, table, starts, seq_lens, seq_len, HEAD_DIM ** -0.5,
                None, 0, config))
        except Exception as e:  # a tile config past the SM's shared memory fails to compile
            rows.append(f"{label}  failed: {type(e).__name__}: {str(e)[:100]}")
            continue
        rows.append(f"{label}  {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s")
    if not prefix:
        rows.append(_sdpa_row(q, k, v, batch, seq_len, flops))
    return rows


def _sdpa_row(q, k, v, batch: int, seq_len: int, flops: int) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = HEADS // KV_HEADS
    qc = q.view(batch, seq_len, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    kc, vc = (t.view(batch, seq_len, KV_HEADS, HEAD_DIM).repeat_interleave(group, 2)
              .transpose(1, 2).contiguous() for t in (k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = _median_ms(lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True))
    return (f"prefill torch SDPA flash (contiguous, kv heads expanded)  {ms * 1e3:8.1f} us"
            f"  {flops / ms / 1e9:6.1f} TFLOP/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--prefill-only", action="store_true",
                        help="only prefill: every variant at the served step's shapes, block size 16")
    args = parser.parse_args(argv)
    if args.prefill_only:
        for batch, seq_len, prefix in PREFILL_SHAPES:
            print("\n".join(bench_prefill(batch, seq_len, 16, prefix)), flush=True)
        return
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    rows = [f"device: {torch.cuda.get_device_name()}",
            f"copy bandwidth (D2D, read+write): {copy_gbs:.0f} GB/s"]
    rows += bench_decode(copy_gbs, args.batch, args.contexts)
    for block_size in (16, 64):
        rows += bench_prefill(args.prefill_batch, args.prefill_len, block_size)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
