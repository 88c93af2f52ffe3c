"""Varlen (chunked) prefill attention over the paged KV cache.

A program owns BLOCK_Q query tokens of one sequence times all GROUP query
heads of one KV head (BLOCK_M = BLOCK_Q * GROUP rows), so each K/V tile is
loaded once per GQA group. It walks only the keys its tile can see (cached
prefix + causal part of the chunk, or sink + window), with an online softmax
in fp32 and tl.dot for both matrix products.

The grid is either (sequences, query tiles of the longest query, KV heads x
splits), planned from the batch's host lengths, or, for CUDA-graph replay, a
fixed number of programs that each read their (sequence, query tile) from a
tile table (`PrefillTiles`): the table is rewritten before every replay, and
entries past the batch's tiles hold sequence -1, so those programs exit.

Split-KV: a short chunk beside running decodes has one or two query tiles,
so eight programs (one per KV head) would each walk a whole context while
the other SMs idle: on an H200 a 16-token chunk at ~1K keys took 41 us a
layer (`benchmarks/mixed_step_bench.py`). Small steps therefore divide each
tile's visible keys over several programs; each writes a normalised partial
and its log2-sum-exp, and a reduce (one program per query token of the same
tiles) merges them: 20 us a layer, kernel and reduce, for that chunk. The
split count depends only on the launch's shapes, so a captured graph keeps it.
Programs with no rows still cost a slot on an SM (this kernel's shared memory
allows two a SM), so graphs keep their tile tables short (`runner/mixed_graph.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvserve.attention.metadata import PrefillTiles
from kvserve.attention.kernels.common import (dot_precision, merge_splits, online_softmax_tile,
                                              score_tile, split_range, store_split, visible_range)
from kvserve.attention.kernels.decode import sm_count

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
MAX_INT32 = 2**31 - 1   # `only_up_to` when every query length is computed here
# Bytes of fp32 partials a split launch may allocate ([tokens, heads, splits, head_dim]):
# steps large enough to need more have query tiles enough to fill the GPU unsplit.
PARTIALS_BUDGET = 16 << 20


@dataclass(frozen=True)
class PrefillConfig:
    # Fastest of four on an H200 (benchmarks/kernel_notes.md): 300 vs 269
    # TFLOP/s for (128, 64, 8 warps, 3 stages).
    block_m: int = 128   # query rows (tokens x heads of one GQA group)
    block_n: int = 32    # keys per tile
    num_warps: int = 4
    num_stages: int = 4
    waves: int = 2                 # split small steps up to this many programs per SM
    min_split_keys: int = 256      # never split a context below this many keys per program
    num_splits: int | None = None  # fixed split count (tests, sweeps); None = `plan_splits`
    # Whole key tiles before a query tile's first query run without masks (full attention);
    # False masks every tile, as the kernel did before (bench A/B).
    unmasked_before: bool = True

    def block_q(self, num_heads: int, num_kv_heads: int) -> int:
        """Query tokens per program: BLOCK_M rows hold all heads of one GQA group."""
        group = num_heads // num_kv_heads
        return max(self.block_m, triton.next_power_of_2(group)) // group

    def plan_splits(self, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    max_keys: int, num_sms: int) -> int:
        """Programs per (query tile, KV head) for a launch over `num_tokens`
        query tokens and contexts up to `max_keys`: enough for `waves` waves
        if the tokens were one sequence's, within `min_split_keys` and the
        partials budget."""
        if self.num_splits is not None:
            return self.num_splits
        tiles = triton.cdiv(num_tokens, self.block_q(num_heads, num_kv_heads))
        wanted = triton.cdiv(self.waves * num_sms, tiles * num_kv_heads)
        by_keys = max_keys // self.min_split_keys
        by_memory = PARTIALS_BUDGET // max(1, num_tokens * num_heads * head_dim * 4)
        return max(1, min(wanted, by_keys, by_memory, MAX_SPLITS))


def tile_table(query_lens: torch.Tensor, block_q: int,
               skip_single: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq, q_tile) of every query tile of a batch, host int32 tensors.
    `skip_single` leaves out one-query sequences (the decode kernel's rows in
    a mixed batch), so no program is spent on them.

    numpy, not torch: on a served H200 run torch's CPU repeat_interleave took
    ~200 us per step here, a tenth of the engine core's busy time."""
    lens = query_lens.numpy().astype(np.int64)
    tiles = (lens + block_q - 1) // block_q
    if skip_single:
        tiles[lens == 1] = 0
    seq = np.repeat(np.arange(len(tiles), dtype=np.int32), tiles)
    first = np.cumsum(tiles) - tiles
    q_tile = (np.arange(len(seq), dtype=np.int64) - first[seq]).astype(np.int32)
    return torch.from_numpy(seq), torch.from_numpy(q_tile)


@triton.jit
def _attend_before(q, k_cache_ptr, v_cache_ptr, start, end, table_row, stride_cache_block,
                   stride_cache_offset, kv_head_offset, m_i, l_i, acc, qk_scale,
                   BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold whole key tiles [start, end) that every row of the tile sees (all before its
    first query, full attention) into the online softmax: no masks, no bounds."""
    dims = tl.arange(0, HEAD_DIM)
    for tile in range(start, end, BLOCK_N):
        key = tile + tl.arange(0, BLOCK_N)
        page = tl.load(table_row + key // PAGE_SIZE)
        offs = page.to(tl.int64) * stride_cache_block + (key % PAGE_SIZE) * stride_cache_offset + kv_head_offset
        k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_visible(q, q_pos, first_pos, k_cache_ptr, v_cache_ptr, start, end, sink_end, lo, table_row,
                    stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale, window, sink,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    UNMASKED_BEFORE: tl.constexpr):
    """Online softmax of the query rows (at positions q_pos) over the tile's
    visible keys [start, end) (virtual indices), masked causally (and by
    window + sink): (running max, running sum, unnormalised output).

    With full attention, the whole tiles before the tile's first query
    (`first_pos`) are seen by every row: they run without masks or bounds
    checks, and only the tiles reaching the diagonal pay for them."""
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if UNMASKED_BEFORE and not SLIDING:  # start is a multiple of BLOCK_N (split_range), so whole tiles stay whole
        before = tl.maximum(tl.minimum(end, (first_pos // BLOCK_N) * BLOCK_N), start)
        m_i, l_i, acc = _attend_before(q, k_cache_ptr, v_cache_ptr, start, before, table_row,
                                       stride_cache_block, stride_cache_offset, kv_head_offset,
                                       m_i, l_i, acc, qk_scale, BLOCK_M, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                                       DOT_PRECISION)
        start = before
    for tile in range(start, end, BLOCK_N):
        key, key_valid, v_ptrs, s = score_tile(
            q, k_cache_ptr, v_cache_ptr, tile + tl.arange(0, BLOCK_N), end, sink_end, lo,
            table_row, stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale,
            HEAD_DIM, PAGE_SIZE, DOT_PRECISION)
        visible = key_valid[None, :] & (key[None, :] <= q_pos[:, None])
        if SLIDING:
            visible &= ((q_pos[:, None] - key[None, :]) < window) | (key[None, :] < sink)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_tile(s, m_i, l_i, acc, v_ptrs, key_valid, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _program_tile(query_start_loc_ptr, tile_seq_ptr, tile_q_ptr, max_q_len, BLOCK_Q: tl.constexpr,
                  TILED: tl.constexpr, SKIP_SINGLE: tl.constexpr, TILE_STRIDE: tl.constexpr):
    """(sequence, query tile, first query token, query length, idle) of this
    program; an idle program has no rows (past its query, a padding entry of
    the tile table, a one-query row left to the decode kernel, or a query
    longer than `max_q_len`, left to the TMA kernel). Untiled, axis 1 counts
    query tiles times TILE_STRIDE (the reduce's tokens a tile)."""
    if TILED:
        seq = tl.load(tile_seq_ptr + tl.program_id(0))
        q_tile = tl.load(tile_q_ptr + tl.program_id(0))
    else:
        seq = tl.program_id(0)
        q_tile = tl.program_id(1) // TILE_STRIDE
    padding = seq < 0
    seq = tl.maximum(seq, 0)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    idle = padding | (q_tile * BLOCK_Q >= q_len) | (q_len > max_q_len)
    if SKIP_SINGLE:  # one-query rows go to the decode kernel (`decode_attention(single_only=True)`)
        idle = idle | (q_len == 1)
    return seq, q_tile, q_start, q_len, idle


@triton.jit
def _tile_rows(q_tile, q_len, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each of the BLOCK_M rows' query token (within its sequence), head
    within the GQA group, and validity."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP
    return tok, rows % GROUP, (rows < BLOCK_Q * GROUP) & (tok < q_len)


# The block table's row stride changes with every batch's widest table, the split count
# with every eager batch: neither is specialised, so a served run never stops to compile a
# new variant (kernels/warmup.py compiles the rest at start-up).
@triton.jit(do_not_specialize=["stride_table", "num_splits", "max_q_len"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr,
    query_start_loc_ptr, seq_lens_ptr, qk_scale, window, sink,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_cache_block, stride_cache_offset, stride_cache_head, tile_seq_ptr, tile_q_ptr,
    part_out_ptr, part_lse_ptr, num_splits, max_q_len,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TILED: tl.constexpr, SKIP_SINGLE: tl.constexpr,
    DIRECT: tl.constexpr, UNMASKED_BEFORE: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    seq, q_tile, q_start, q_len, idle = _program_tile(query_start_loc_ptr, tile_seq_ptr, tile_q_ptr, max_q_len,
                                                      BLOCK_Q, TILED, SKIP_SINGLE, 1)
    if idle:
        return
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    seq_len = tl.load(seq_lens_ptr + seq)

    tok, group_head, row_valid = _tile_rows(q_tile, q_len, GROUP, BLOCK_M)
    head = kv_head * GROUP + group_head
    q_pos = seq_len - q_len + tok
    dims = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_valid[:, None], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    first_pos = seq_len - q_len + q_tile * BLOCK_Q
    hi = tl.minimum(first_pos + BLOCK_Q, seq_len)
    lo, sink_end = visible_range(first_pos, window, sink, SLIDING)
    start, end = split_range(sink_end + hi - lo, split, num_splits, BLOCK_N)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table
    kv_head_offset = kv_head * stride_cache_head

    m_i, l_i, acc = _attend_visible(q, q_pos, first_pos, k_cache_ptr, v_cache_ptr, start, end, sink_end, lo,
                                    table_row, stride_cache_block, stride_cache_offset,
                                    kv_head_offset, qk_scale, window, sink, BLOCK_M, HEAD_DIM,
                                    PAGE_SIZE, BLOCK_N, SLIDING, DOT_PRECISION, UNMASKED_BEFORE)
    # A split past a row's causal limit holds none of its keys: it merges as weight 0.
    token = (q_start + tok).to(tl.int64)
    store_split(out_ptr, part_out_ptr, part_lse_ptr, m_i, l_i, acc, token, token, head, row_valid,
                split, num_splits, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, DIRECT)


@triton.jit(do_not_specialize=["num_splits", "max_q_len"])
def _prefill_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, tile_seq_ptr, tile_q_ptr,
    stride_ot, stride_oh, num_splits, max_q_len,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
    SPLITS_POW2: tl.constexpr, TILED: tl.constexpr, SKIP_SINGLE: tl.constexpr,
):
    """Merge the splits of one query token's GQA group of heads. The grid is
    the attention launch's with BLOCK_Q tokens a tile on axis 1 and no split
    axis, so it skips the same programs. One token a program, every split
    loaded at once: a program per tile looping over the splits took 19 us a
    layer on an H200 (one 16-token chunk, 16 splits), a chain of dependent loads."""
    seq, q_tile, q_start, q_len, idle = _program_tile(query_start_loc_ptr, tile_seq_ptr, tile_q_ptr, max_q_len,
                                                      BLOCK_Q, TILED, SKIP_SINGLE, BLOCK_Q)
    tok = q_tile * BLOCK_Q + tl.program_id(1) % BLOCK_Q
    if idle | (tok >= q_len):
        return
    token = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    for g in tl.static_range(GROUP):
        head = tl.program_id(2) * GROUP + g
        out = merge_splits(part_out_ptr, part_lse_ptr, (token * NUM_HEADS + head) * num_splits, num_splits,
                           SPLITS_POW2, HEAD_DIM)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                      block_table: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, max_query_len: int, scale: float,
                      window: int | None, sink: int,
                      config: PrefillConfig = PrefillConfig(),
                      tiles: PrefillTiles | None = None,
                      single_queries: bool = True, max_seq_len: int | None = None,
                      only_up_to: int = MAX_INT32) -> torch.Tensor:
    """q/out: [T, H, D]; the cache already holds this step's K/V. With
    `tiles`, the grid is the tile table's length, whatever the batch.
    `single_queries=False` leaves the sequences with one query alone (their
    output rows unwritten), for the decode kernel to attend; `only_up_to`
    likewise the sequences with a longer query (the TMA kernel's), and
    `max_query_len` may then be the longest query it computes. `max_seq_len`
    (the longest context, or a bound) lets small steps split their keys;
    without it they run unsplit."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_m // group  # as config.block_q, which tile tables are built with
    num_splits = _num_splits(q, num_kv_heads, max_seq_len, window, sink, block_q, config)
    direct = num_splits == 1
    # Direct launches never touch the partials: one dummy element stands in.
    part_shape = (1,) if direct else (q.shape[0], num_heads, num_splits, head_dim)
    part_out = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(part_shape[:3], dtype=torch.float32, device=q.device)
    if tiles is None:
        grid = (seq_lens.shape[0], triton.cdiv(max_query_len, block_q), num_kv_heads)
        tile_seq = tile_q = seq_lens  # unread placeholders
    else:
        grid = (tiles.seq.shape[0], 1, num_kv_heads)
        tile_seq, tile_q = tiles.seq, tiles.q_tile
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _prefill_kernel[grid[:2] + (num_kv_heads * num_splits,)](
        q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens,
        scale * LOG2E, window or 0, sink,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), tile_seq, tile_q,
        part_out, part_lse, num_splits, only_up_to,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m, BLOCK_N=config.block_n, SLIDING=window is not None,
        DOT_PRECISION=dot_precision(kv_cache.dtype), TILED=tiles is not None,
        SKIP_SINGLE=not single_queries, DIRECT=direct, UNMASKED_BEFORE=config.unmasked_before,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if not direct:
        _prefill_reduce_kernel[(grid[0], grid[1] * block_q, num_kv_heads)](
            part_out, part_lse, out, query_start_loc, tile_seq, tile_q,
            out.stride(0), out.stride(1), num_splits, only_up_to,
            NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_Q=block_q,
            SPLITS_POW2=max(2, triton.next_power_of_2(num_splits)),
            TILED=tiles is not None, SKIP_SINGLE=not single_queries, num_warps=2)
    return out


def _num_splits(q: torch.Tensor, num_kv_heads: int, max_seq_len: int | None, window: int | None,
                sink: int, block_q: int, config: PrefillConfig) -> int:
    """The launch's split count: 1 without a context bound (unless fixed)."""
    if max_seq_len is None and config.num_splits is None:
        return 1
    max_keys = max_seq_len or 0
    if window is not None:  # a tile sees its sink, its window and its own queries
        max_keys = min(max_keys, window + sink + block_q)
    num_heads, head_dim = q.shape[1:]
    return config.plan_splits(q.shape[0], num_heads, num_kv_heads, head_dim, max_keys,
                              sm_count(q.device))
