"""Attention for a mixed batch: prompt chunks beside one-query (decode) sequences.

Each kernel takes the rows it is built for: the split-KV decode kernel the
sequences with one query, the varlen kernel every longer query. The varlen
kernel alone would give a decode row a whole BLOCK_M-row query tile of which
it fills GROUP rows, and one program walking its whole context: on an H200
(48 decodes at ~1K keys beside a 16-token chunk, Qwen3-8B shape) it took
3.9 ms of the step's device time where the decode kernel takes 1.2 ms for
the same rows (`benchmarks/mixed_step_bench.py`). The varlen kernel splits
a small step's keys over several programs (`prefill.py`), so a short chunk
does not leave the GPU to eight programs. The cache holds the step's K/V
before this runs (`reshape_and_cache`).
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from kvserve.attention.kernels.common import optional_gluon_module
from kvserve.attention.kernels.decode import decode_attention
from kvserve.attention.kernels.decode_work import work_decode_attention
from kvserve.attention.kernels.prefill import PrefillConfig, prefill_attention
from kvserve.attention.kernels.prefill_tma import prefill_attention_tma, supports_tma
from kvserve.attention.metadata import PrefillTiles

logger = logging.getLogger(__name__)

# An eager step of many prompt tokens (graphs keep the default: their tile tables are built
# for it) runs 256-row tiles of 64 keys on 8 warps: 4-16% faster than the default at a served
# 8K-token step's shapes on an H200 (2026-12-01, docs/BENCHMARKS.md), measured with full
# attention only. Their shared memory needs a 2-byte cache and head_dim <= 128.
LARGE_TILES = PrefillConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)
LARGE_TILES_MIN_TOKENS = 4096
# Eager steps from here up read their prompt rows' own keys through TMA (`prefill_tma.py`):
# every step past the largest mixed graph (2,048 tokens), and enough query tiles to fill
# the GPU without split-KV, which that kernel lacks.
TMA_MIN_TOKENS = 2048
# ...and whose chunks' own keys carry at least this share of the prompt rows' attention
# (the rest is over cached prefixes, which both kernels gather): see prefill_tma.py.
TMA_MIN_FRESH_SHARE = 1 / 3
# ...and whose longest chunk is at least this long: over short chunks the paged kernel's
# large tiles win, for reasons not yet known (H200, fresh prompts: 8 x 1,024 381 against
# 252 us; 2 x 4,096 629 against 766).
TMA_MIN_LONGEST_CHUNK = 2048
# In a step that takes the TMA path, prompt chunks shorter than this go to the paged
# kernel's large tiles in a second launch (0: all to the TMA kernel). Off: over the served
# mixed burst's prompts it spent 581 ms in attention against 546 with all chunks in the TMA
# kernel (H200, eb946d1; `benchmarks/burst_attention_ab.py`, whose "split" policy sets 2,048).
TMA_SHORT_CHUNKS_PAGED_BELOW = 0


# The Gluon kernel's own gates (`tma_gates`): none. It beat the paged kernel's large tiles at
# every step timed, short chunks and long prefixes included (0.65-0.86x its time: 64 x 32
# tokens, 32 x 64 after 700, 1 x 2,048 after 30,000, ...; H200, `benchmarks/tma_kernel_ab.py`,
# 2026-12-04). Not timed: a few short chunks after very long prefixes, where the paged
# kernel's split-KV would spread what one Gluon program walks alone.
GLUON_MIN_LONGEST_CHUNK = 0
GLUON_MIN_FRESH_SHARE = 0.0
# The TMA path runs the warp-specialized Gluon kernel (`prefill_gluon.py`) where it serves the
# launch, else the Triton one. KVSERVE_GLUON_PREFILL=0 keeps the Triton kernel (A/B runs); a
# Gluon kernel that fails to build at warm-up switches itself off (`disable_gluon`).
_GLUON_OFF = {"reason": "KVSERVE_GLUON_PREFILL=0" if os.environ.get("KVSERVE_GLUON_PREFILL") == "0" else None}


def _gluon_module():
    """The Gluon kernel's module, or None where this Triton lacks Gluon's Hopper API."""
    return optional_gluon_module("kvserve.attention.kernels.prefill_gluon", "the TMA path runs the Triton kernel")


def gluon_prefill(q: torch.Tensor, kv_cache: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """`prefill_attention_gluon` where it serves this launch's shapes and is on; else None."""
    if _GLUON_OFF["reason"] is not None:
        return None
    module = _gluon_module()
    if module is None or not module.supports_gluon(q, kv_cache):
        return None
    return module.prefill_attention_gluon


def disable_gluon(reason: str) -> None:
    logger.warning("Gluon prefill kernel switched off (%s): the TMA path runs the Triton kernel", reason)
    _GLUON_OFF["reason"] = reason


def short_chunk_bound(q: torch.Tensor, kv_cache: torch.Tensor, cached_prefixes: bool) -> int:
    """On the TMA path, prompt chunks shorter than this go to the paged kernel: the Gluon
    kernel's prefix tiles read whole pages, so with cached prefixes it takes chunks of a
    page or more (`prefill_gluon.py`); otherwise TMA_SHORT_CHUNKS_PAGED_BELOW."""
    if cached_prefixes and q.is_cuda and gluon_prefill(q, kv_cache) is not None:
        return max(TMA_SHORT_CHUNKS_PAGED_BELOW, kv_cache.shape[2])
    return TMA_SHORT_CHUNKS_PAGED_BELOW


def tma_gates(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, float]:
    """(longest chunk, fresh-key share) a large eager step needs for the TMA path: the Gluon
    kernel's where it serves the launch, else the Triton kernel's."""
    if q.is_cuda and gluon_prefill(q, kv_cache) is not None:
        return GLUON_MIN_LONGEST_CHUNK, GLUON_MIN_FRESH_SHARE
    return TMA_MIN_LONGEST_CHUNK, TMA_MIN_FRESH_SHARE


def takes_tma(num_tokens: int, head_dim: int, window: int | None) -> bool:
    """Whether an eager step's prompt rows read their own chunk's keys through TMA
    (`prefill_tma.py`; the device and layout checks are `supports_tma`'s)."""
    return num_tokens >= TMA_MIN_TOKENS and head_dim <= 128 and window is None


def takes_large_tiles(num_tokens: int, head_dim: int, element_size: int, window: int | None) -> bool:
    return num_tokens >= LARGE_TILES_MIN_TOKENS and head_dim <= 128 and element_size == 2 and window is None


def mixed_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int, scale: float,
                    window: int | None, sink: int, tiles: PrefillTiles | None = None,
                    prefill_config: PrefillConfig = PrefillConfig(),
                    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    cached_prefixes: bool = True, paged_below: int = 0,
                    longest_paged: int = 0, decode_work=None,
                    tile_list: Callable[[int], torch.Tensor | None] | None = None) -> torch.Tensor:
    """q/out: [T, H, D]; lengths as `prefill_attention`'s, `max_seq_len` the
    longest context (a bound under CUDA graphs, like `max_query_len`); `tiles`
    are built for `prefill_config`'s query tile. Without tiles and a config of
    its own, a large step's prompt rows read their chunk's keys from `fresh_kv`
    (this step's K/V, [T, KVH, D]) through TMA where the GPU allows, or take
    LARGE_TILES. `cached_prefixes=False` (no prompt row has a cached prefix) lets the TMA
    path run its kernel without the prefix loop. On the TMA path, prompt chunks shorter than
    `paged_below` take the paged kernel instead (`longest_paged`: the longest of them; 0:
    none, one launch). `decode_work`: the one-query rows' work list (`decode_work.py`; full
    attention only), else the decode kernel's even splits. `tile_list(min_q_len)`: the Gluon
    kernel's work items for the prompt rows of at least that many tokens (`prefill_gluon.plan_tiles`,
    on the device); without it that kernel runs its full grid."""
    if decode_work is not None:
        work_decode_attention(q, kv_cache, out, block_table, query_start_loc, seq_lens, scale, decode_work)
    else:
        decode_attention(q, kv_cache, out, block_table, query_start_loc, seq_lens, max_seq_len,
                         scale, window, sink, single_only=True)
    eager_default = tiles is None and prefill_config == PrefillConfig()
    if eager_default and fresh_kv is not None and takes_tma(q.shape[0], q.shape[-1], window) \
            and supports_tma(q, *fresh_kv, kv_cache):
        split = paged_below if longest_paged else 0
        _tma_prefill(q, fresh_kv, kv_cache, out, block_table, query_start_loc, seq_lens, max_query_len, scale,
                     cached_prefixes, split, paged_below, tile_list)
        if not split:
            return out
        return prefill_attention(q, kv_cache, out, block_table, query_start_loc, seq_lens, longest_paged,
                                 scale, window, sink, config=_eager_config(q, kv_cache, window),
                                 single_queries=False, max_seq_len=max_seq_len, only_up_to=split - 1)
    if eager_default:
        prefill_config = _eager_config(q, kv_cache, window)
    return prefill_attention(q, kv_cache, out, block_table, query_start_loc, seq_lens,
                             max_query_len, scale, window, sink, config=prefill_config, tiles=tiles,
                             single_queries=False, max_seq_len=max_seq_len)


def _tma_prefill(q, fresh_kv, kv_cache, out, block_table, query_start_loc, seq_lens, max_query_len: int,
                 scale: float, cached_prefixes: bool, split: int, paged_below: int,
                 tile_list: Callable[[int], torch.Tensor | None] | None = None) -> None:
    """The TMA path's kernel over the prompt rows of `split` tokens or more: Gluon where it
    serves the launch (with cached prefixes, only when shorter chunks are sent elsewhere:
    `short_chunk_bound`), else Triton's."""
    gluon = gluon_prefill(q, kv_cache)
    if gluon is not None and (not cached_prefixes or paged_below >= kv_cache.shape[2]):
        min_q_len = max(split, 2)
        gluon(q, *fresh_kv, kv_cache, out, block_table, query_start_loc, seq_lens, max_query_len, scale,
              cached_prefixes=cached_prefixes, min_q_len=min_q_len,
              tiles=tile_list(min_q_len) if tile_list is not None else None)
    else:
        prefill_attention_tma(q, *fresh_kv, kv_cache, out, block_table, query_start_loc, seq_lens,
                              max_query_len, scale, single_queries=False, cached_prefixes=cached_prefixes,
                              from_length=split)


def _eager_config(q: torch.Tensor, kv_cache: torch.Tensor, window: int | None) -> PrefillConfig:
    """The paged kernel's tiles for an eager step of q's tokens."""
    if takes_large_tiles(q.shape[0], q.shape[-1], kv_cache.element_size(), window):
        return LARGE_TILES
    return PrefillConfig()
