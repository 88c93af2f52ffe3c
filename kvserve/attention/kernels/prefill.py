"""Varlen (chunked) prefill attention over the paged KV cache.

A program owns BLOCK_Q query tokens of one sequence times all GROUP query
heads of one KV head (BLOCK_M = BLOCK_Q * GROUP rows), so each K/V tile is
loaded once per GQA group. It walks only the keys its tile can see (cached
prefix + causal part of the chunk, or sink + window), with an online softmax
in fp32 and tl.dot for both matrix products.

The grid is either (sequences, query tiles of the longest query, KV heads),
planned from the batch's host lengths, or, for CUDA-graph replay, a fixed
number of programs that each read their (sequence, query tile) from a tile
table (`PrefillTiles`): the table is rewritten before every replay, and
entries past the batch's tiles hold sequence -1, so those programs exit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvserve.attention.metadata import PrefillTiles
from kvserve.attention.kernels.common import (dot_precision, online_softmax_tile, score_tile,
                                              visible_range)

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    # Fastest of four on an H200 (benchmarks/kernel_notes.md): 300 vs 269
    # TFLOP/s for (128, 64, 8 warps, 3 stages).
    block_m: int = 128   # query rows (tokens x heads of one GQA group)
    block_n: int = 32    # keys per tile
    num_warps: int = 4
    num_stages: int = 4

    def block_q(self, num_heads: int, num_kv_heads: int) -> int:
        """Query tokens per program: BLOCK_M rows hold all heads of one GQA group."""
        group = num_heads // num_kv_heads
        return max(self.block_m, triton.next_power_of_2(group)) // group


def tile_table(query_lens: torch.Tensor, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq, q_tile) of every query tile of a batch, host int32 tensors.

    numpy, not torch: on a served H200 run torch's CPU repeat_interleave took
    ~200 us per step here, a tenth of the engine core's busy time."""
    tiles = (query_lens.numpy().astype(np.int64) + block_q - 1) // block_q
    seq = np.repeat(np.arange(len(tiles), dtype=np.int32), tiles)
    first = np.cumsum(tiles) - tiles
    q_tile = (np.arange(len(seq), dtype=np.int64) - first[seq]).astype(np.int32)
    return torch.from_numpy(seq), torch.from_numpy(q_tile)


@triton.jit
def _attend_visible(q, q_pos, k_cache_ptr, v_cache_ptr, num_keys, sink_end, lo, table_row,
                    stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale, window, sink,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of the query rows (at positions q_pos) over the tile's
    visible keys, masked causally (and by window + sink): (running sum,
    unnormalised output)."""
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, num_keys, BLOCK_N):
        key, key_valid, v_ptrs, s = score_tile(
            q, k_cache_ptr, v_cache_ptr, start + tl.arange(0, BLOCK_N), num_keys, sink_end, lo,
            table_row, stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale,
            HEAD_DIM, PAGE_SIZE, DOT_PRECISION)
        visible = key_valid[None, :] & (key[None, :] <= q_pos[:, None])
        if SLIDING:
            visible &= ((q_pos[:, None] - key[None, :]) < window) | (key[None, :] < sink)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_tile(s, m_i, l_i, acc, v_ptrs, key_valid, DOT_PRECISION)
    return l_i, acc


# The block table's row stride changes with every batch's widest table: not
# specialised, so a served run never stops to compile a new variant.
@triton.jit(do_not_specialize=["stride_table"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr,
    query_start_loc_ptr, seq_lens_ptr, qk_scale, window, sink,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_cache_block, stride_cache_offset, stride_cache_head, tile_seq_ptr, tile_q_ptr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TILED: tl.constexpr, SKIP_SINGLE: tl.constexpr,
):
    if TILED:
        seq = tl.load(tile_seq_ptr + tl.program_id(0))
        q_tile = tl.load(tile_q_ptr + tl.program_id(0))
        if seq < 0:
            return
    else:
        seq = tl.program_id(0)
        q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    if SKIP_SINGLE:  # one-query rows go to the decode kernel (`decode_attention(single_only=True)`)
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = seq_len - q_len + tok
    dims = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_valid[:, None], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    first_pos = seq_len - q_len + q_tile * BLOCK_Q
    hi = tl.minimum(first_pos + BLOCK_Q, seq_len)
    lo, sink_end = visible_range(first_pos, window, sink, SLIDING)
    num_keys = sink_end + hi - lo
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table
    kv_head_offset = kv_head * stride_cache_head

    l_i, acc = _attend_visible(q, q_pos, k_cache_ptr, v_cache_ptr, num_keys, sink_end, lo,
                               table_row, stride_cache_block, stride_cache_offset, kv_head_offset,
                               qk_scale, window, sink, BLOCK_M, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                               SLIDING, DOT_PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_offs + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None])


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                      block_table: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, max_query_len: int, scale: float,
                      window: int | None, sink: int,
                      config: PrefillConfig = PrefillConfig(),
                      tiles: PrefillTiles | None = None,
                      single_queries: bool = True) -> torch.Tensor:
    """q/out: [T, H, D]; the cache already holds this step's K/V. With
    `tiles`, the grid is the tile table's length, whatever the batch.
    `single_queries=False` leaves the sequences with one query alone (their
    output rows unwritten), for the decode kernel to attend."""
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_m // group  # as config.block_q, which tile tables are built with
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if tiles is None:
        grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
        tile_seq = tile_q = seq_lens  # unread placeholders
    else:
        grid = (tiles.seq.shape[0], 1, num_kv_heads)
        tile_seq, tile_q = tiles.seq, tiles.q_tile
    _prefill_kernel[grid](
        q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens,
        scale * LOG2E, window or 0, sink,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), tile_seq, tile_q,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m, BLOCK_N=config.block_n, SLIDING=window is not None,
        DOT_PRECISION=dot_precision(kv_cache.dtype), TILED=tiles is not None,
        SKIP_SINGLE=not single_queries,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
