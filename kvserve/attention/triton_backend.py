"""The Triton attention backend: paged KV write + prefill / decode kernels.

Owns the choice of kernel per batch: decode-only batches (max_query_len == 1)
go to the split-KV decode kernel (with a shared-prefix plan in the metadata, full-attention
layers to the cascade kernels, `kernels/cascade.py`). In any batch with a longer query (prefill,
chunked prefill, or prefill mixed with decodes) the one-query sequences still
go to the decode kernel and the rest to the varlen prefill kernel
(`kernels/mixed.py`; in large eager steps the prompt rows read their own
chunk's keys from this step's K/V through TMA, `kernels/prefill_tma.py`).
Decode batches write their new K/V
inside the decode kernel; other batches run the cache-write kernel first.
Grid sizes come from the metadata's host
copies, so forward issues no host-device synchronisation.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton  # noqa: F401  (an ImportError here keeps the backend unregistered)

from kvserve.attention.backend import AttentionLayerInfo, register_backend
from kvserve.attention.kernels import decode_attention, mixed_attention, reshape_and_cache
from kvserve.attention.kernels.cascade import cascade_decode_attention
from kvserve.attention.kernels.decode_work import work_decode_attention
from kvserve.attention.kernels.mixed import short_chunk_bound, takes_tma, tma_gates
from kvserve.attention.metadata import AttentionMetadata


@register_backend("triton")
class TritonAttentionBackend:
    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, layer: AttentionLayerInfo,
                meta: AttentionMetadata) -> torch.Tensor:
        _check_layout(q, k, v, kv_cache)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if meta.num_tokens == 0:
            return out
        slots = meta.slot_mappings[layer.group_id]
        window, sink = mask_bounds(layer)
        args = (q, kv_cache, out, meta.block_tables[layer.group_id],
                meta.query_start_loc, meta.seq_lens)
        if meta.is_decode_only:  # the decode kernel writes the new K/V itself
            if meta.cascade is not None and window is None and not sink:   # shared prefixes read once
                return cascade_decode_attention(*args, meta.max_seq_len, layer.scale, meta.cascade,
                                                new_kv=(k, v, slots))
            if meta.decode_work is not None and window is None and not sink:   # each sequence its own splits
                return work_decode_attention(*args, layer.scale, meta.decode_work, new_kv=(k, v, slots))
            return decode_attention(*args, meta.max_seq_len, layer.scale, window, sink,
                                    new_kv=(k, v, slots))
        reshape_and_cache(k, v, kv_cache, slots)
        fresh_kv = (k, v) if _takes_fresh_kv(meta, q, kv_cache, window) else None
        cached_prefixes = fresh_kv is None or meta.fresh_key_share() < 1.0
        paged_below = short_chunk_bound(q, kv_cache, cached_prefixes) if fresh_kv is not None else 0
        return mixed_attention(*args, meta.max_query_len, meta.max_seq_len, layer.scale, window, sink,
                               tiles=meta.prefill_tiles, fresh_kv=fresh_kv, cached_prefixes=cached_prefixes,
                               paged_below=paged_below,
                               longest_paged=meta.longest_chunk_below(paged_below) if fresh_kv is not None else 0,
                               decode_work=meta.decode_work if window is None and not sink else None,
                               tile_list=gluon_tile_list(meta, q, kv_cache) if fresh_kv is not None else None)


def gluon_tile_list(meta: AttentionMetadata, q: torch.Tensor, kv_cache: torch.Tensor) -> Callable[[int], torch.Tensor | None]:
    """The Gluon prefill kernel's work items for the step's prompt rows of at least n query
    tokens (`prefill_gluon.plan_tiles`), planned from the host lengths and uploaded once a step
    (every layer's launch reads the same list; kept in `meta.scratch`). None where the launch
    would take its full grid anyway (`takes_list` on the host lengths): nothing is planned."""
    group = q.shape[1] // kv_cache.shape[3]

    def tiles(min_q_len: int) -> torch.Tensor | None:
        key = ("gluon_tiles", group, min_q_len)
        if key not in meta.scratch:
            meta.scratch[key] = _planned_tiles(meta, group, min_q_len, q.device)
        return meta.scratch[key]
    return tiles


def _planned_tiles(meta: AttentionMetadata, group: int, min_q_len: int, device: torch.device) -> torch.Tensor | None:
    from kvserve.attention.kernels.prefill_gluon import count_tiles, plan_tiles, takes_list
    from kvserve.runner.staging import upload   # pinned, non-blocking: no wait for the step in flight
    items = count_tiles(meta.query_lens_cpu, group, min_q_len)
    if not takes_list(meta.max_query_len, len(meta.seq_lens_cpu), group, items):
        return None
    return upload(torch.from_numpy(plan_tiles(meta.query_lens_cpu, meta.seq_lens_cpu, group, min_q_len)), device)


def _takes_fresh_kv(meta: AttentionMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    window: int | None) -> bool:
    """Whether a step hands its own K/V to the TMA prefill path: an eager step the path
    serves (`takes_tma`, which `mixed_attention` checks again with the device), whose longest
    chunk and share of attention over the chunks' own keys pass the path's kernel's gates
    (`tma_gates`: with long cached prefixes the paged kernel may read those better)."""
    if meta.prefill_tiles is not None or not takes_tma(meta.num_tokens, q.shape[-1], window):
        return False
    longest, share = tma_gates(q, kv_cache)
    return meta.max_query_len >= longest and meta.fresh_key_share() >= share


def mask_bounds(layer: AttentionLayerInfo) -> tuple[int | None, int]:
    """(window or None for full attention, sink) of the layer's spec.

    Duck-typed like the torch reference, so a new windowed spec needs no change.
    """
    return getattr(layer.spec, "window", None), layer.spec.sink


def _check_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor) -> None:
    head_dim = kv_cache.shape[-1]
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton backend needs a power-of-two head_dim >= 16, got {head_dim}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous [2, num_blocks, block_size, KVH, D]")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last (head_dim) axis")
    if q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of "
                         f"{kv_cache.shape[3]} KV heads")
