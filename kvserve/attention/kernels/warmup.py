"""Start-up compiles of the attention kernels' variants that eager steps can pick.

Triton compiles a kernel on the first launch of each variant (its constexprs and
launch config). Graph capture compiles what its buckets use, but a step too large
for any graph runs eagerly and plans its split counts from its own batch; the first
such step with a variant not seen yet would compile it while requests wait (a
fraction of a second to seconds each; the step trace's `jit_ms` column shows it).
Launching each variant once on a tiny batch moves those compiles to start-up (later
starts load them from Triton's disk cache). The host stalls of a served mixed burst
(2026-12-01, docs/BENCHMARKS.md) were not compiles: their `jit_ms` was 0.

Split counts are not specialised (`do_not_specialize` in both kernels), so one
launch per variant class covers them all: direct or split, and for the reduces each
power of two their split loads are padded to; the prefill kernel in both of its
eager tile configs (kernels/mixed.py), and the TMA prefill kernel of large eager
steps where the GPU takes it (kernels/prefill_tma.py), with its Gluon kernel over the
full grid and over a work list.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from kvserve.attention.backend import AttentionLayerInfo
from kvserve.attention.kernels.decode import MAX_SPLITS as DECODE_MAX_SPLITS
from kvserve.attention.kernels.decode import DecodeConfig, decode_attention
from kvserve.attention.kernels.mixed import (LARGE_TILES, LARGE_TILES_MIN_TOKENS, TMA_MIN_TOKENS, disable_gluon,
                                             gluon_prefill, takes_large_tiles, takes_tma)
from kvserve.attention.kernels.prefill import MAX_SPLITS as PREFILL_MAX_SPLITS
from kvserve.attention.kernels.prefill import PrefillConfig, prefill_attention
from kvserve.attention.kernels.prefill_tma import prefill_attention_tma, supports_tma
from kvserve.attention.triton_backend import mask_bounds

logger = logging.getLogger(__name__)

CONTEXT = 64        # keys of the tiny batch's sequences
PREFILL_QUERY = 16  # query tokens of its prefill sequence
LIST_GRID_BOUND = 1 << 16   # a max_query_len whose full grid a one-item work list always beats


def split_counts(max_splits: int) -> list[int]:
    """1 (direct), then one count for each power of two a reduce pads to: 2, 3, 5, 9, ..."""
    counts, n = [1, 2], 2
    while n < max_splits:
        counts.append(n + 1)
        n *= 2
    return counts


def warm_eager_attention(layers: list[AttentionLayerInfo], block_size: int, dtype: torch.dtype,
                         device: torch.device) -> int:
    """Launch every eager variant once for each distinct layer shape; returns the launches."""
    shapes = {(layer.num_heads, layer.num_kv_heads, layer.head_dim, *mask_bounds(layer), layer.scale)
              for layer in layers}
    return sum(_warm_shape(*shape, block_size, dtype, device) for shape in sorted(shapes, key=str))


def _warm_shape(heads: int, kv_heads: int, head_dim: int, window: int | None, sink: int, scale: float,
                block_size: int, dtype: torch.dtype, device: torch.device) -> int:
    batch = _TinyBatch(heads, kv_heads, head_dim, block_size, dtype, device)
    launches = 0
    for num_splits in split_counts(DECODE_MAX_SPLITS):
        config = DecodeConfig(num_splits=num_splits)
        for single_only, new_kv in ((True, None), (False, batch.new_kv())):
            decode_attention(*batch.args(decode=not single_only), batch.bound(config.split_block_n, num_splits),
                             scale, window, sink, config=config, new_kv=new_kv, single_only=single_only)
            launches += 1
    configs = [PrefillConfig()]
    if takes_large_tiles(LARGE_TILES_MIN_TOKENS, head_dim, batch.kv_cache.element_size(), window):
        configs.append(LARGE_TILES)   # a large eager step's (kernels/mixed.py)
    for config in configs:
        for num_splits in split_counts(PREFILL_MAX_SPLITS):
            prefill_attention(*batch.args(decode=False), PREFILL_QUERY, scale, window, sink,
                              config=replace(config, num_splits=num_splits), single_queries=False,
                              max_seq_len=CONTEXT)
            launches += 1
    launches += _warm_tma(batch, scale, window)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return launches


def _warm_tma(batch: "_TinyBatch", scale: float, window: int | None) -> int:
    """The TMA prefill kernel, with and without its prefix loop, where a large eager step of
    this shape would take it."""
    q, kv_cache, out, tables, starts, seq_lens = batch.args(decode=False)
    if not takes_tma(TMA_MIN_TOKENS, q.shape[-1], window):
        return 0
    k = torch.zeros(q.shape[0], *kv_cache.shape[3:], dtype=kv_cache.dtype, device=q.device)
    if not supports_tma(q, k, k, kv_cache):
        return 0
    for cached_prefixes in (True, False):
        prefill_attention_tma(q, k, k, kv_cache, out, tables, starts, seq_lens, PREFILL_QUERY, scale,
                              single_queries=False, cached_prefixes=cached_prefixes)
    return 2 + _warm_gluon(q, k, kv_cache, out, tables, starts, seq_lens, scale)


def _warm_gluon(q, k, kv_cache, out, tables, starts, seq_lens, scale: float) -> int:
    """The TMA path's Gluon kernel, both builds, where it serves this shape; one that fails
    to build switches the Gluon kernel off (the Triton kernel serves instead)."""
    gluon = gluon_prefill(q, kv_cache)
    if gluon is None:
        return 0
    try:
        for cached_prefixes in (True, False):
            gluon(q, k, k, kv_cache, out, tables, starts, seq_lens, PREFILL_QUERY, scale,
                  cached_prefixes=cached_prefixes)
    except Exception as e:  # noqa: BLE001 - any build failure: the Triton kernel serves instead
        disable_gluon(f"{type(e).__name__}: {str(e)[:500]}")
        return 0
    return 2 + _warm_gluon_list(gluon, q, k, kv_cache, out, tables, starts, seq_lens, scale)


def _warm_gluon_list(gluon, q, k, kv_cache, out, tables, starts, seq_lens, scale: float) -> int:
    """The Gluon kernel over a work list (`LISTED`), both builds. A large eager step takes the
    list once one-query rows sit beside its prompt rows (the full grid would give each of them
    the longest prompt's tiles): on a cold Triton cache the qa scenario's first such step
    compiled for 2.5 s (H100, 2026-12-06, docs/BENCHMARKS.md). Here the tiny batch's prompt row
    is the list, and the grid bound is set high enough that the launch takes it. A failure
    here leaves the kernel on: the variant then compiles at its first step, as before."""
    try:
        tiles = _one_row_list(q, kv_cache)
        for cached_prefixes in (True, False):
            gluon(q, k, k, kv_cache, out, tables, starts, seq_lens, LIST_GRID_BOUND, scale,
                  cached_prefixes=cached_prefixes, tiles=tiles)
    except Exception as e:  # noqa: BLE001 - its own variant only: the kernel still serves full grids
        logger.warning("warming the Gluon prefill kernel's listed launch failed (%s: %s); it compiles "
                       "at its first step instead", type(e).__name__, str(e)[:500])
        return 0
    return 2


def _one_row_list(q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """The Gluon kernel's work list for the tiny batch's prompt row, on q's device."""
    from kvserve.attention.kernels.prefill_gluon import plan_tiles
    group = q.shape[1] // kv_cache.shape[3]
    return torch.from_numpy(plan_tiles([1, PREFILL_QUERY], [CONTEXT, CONTEXT], group)).to(q.device)


class _TinyBatch:
    """One decode row and one prefill row of CONTEXT keys each over a zeroed cache (blocks
    from 1 on; the NULL block 0 stays zero)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        blocks = -(-CONTEXT // block_size)
        self.kv_cache = torch.zeros(2, 2 * blocks + 1, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.tables = torch.arange(1, 2 * blocks + 1, dtype=torch.int32, device=device).view(2, blocks)
        self.seq_lens = torch.full((2,), CONTEXT, dtype=torch.int32, device=device)
        self.q = torch.zeros(1 + PREFILL_QUERY, heads, head_dim, dtype=dtype, device=device)
        self.shape = (kv_heads, head_dim, dtype, device)

    def args(self, decode: bool) -> tuple:
        """(q, kv_cache, out, block_table, query_start_loc, seq_lens): decode alone, or both rows."""
        if decode:
            q, tables, seq_lens, ends = self.q[:1], self.tables[:1], self.seq_lens[:1], [0, 1]
        else:
            q, tables, seq_lens, ends = self.q, self.tables, self.seq_lens, [0, 1, 1 + PREFILL_QUERY]
        starts = torch.tensor(ends, dtype=torch.int32, device=q.device)
        return q, self.kv_cache, torch.empty_like(q), tables, starts, seq_lens

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv_heads, head_dim, dtype, device = self.shape
        k = torch.zeros(1, kv_heads, head_dim, dtype=dtype, device=device)
        return k, k.clone(), torch.full((1,), -1, dtype=torch.int64, device=device)   # slot -1: not stored

    @staticmethod
    def bound(split_block_n: int, num_splits: int) -> int:
        """A context bound that lets the decode plan keep `num_splits` (it caps splits at its tiles)."""
        return max(CONTEXT, split_block_n * num_splits)
