"""Decode attention (one query per sequence) with split-KV, plus the reduce.

Grid (sequence, KV head, split): a program loads the GROUP query heads that
share one KV head as the rows of a tl.dot, so each K/V page is read once per
GQA group, and walks its split's slice of the visible keys (sink + window for
sliding layers). Each split writes a normalised partial output and its
log2-sum-exp; the reduce kernel merges the splits of one (sequence, head).
A single split writes the final output itself and the reduce is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kvserve.attention.kernels.common import (dot_precision, group_queries, merge_splits, online_softmax_tile,
                                              score_tile, split_range, store_split, visible_range)

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64            # keys per tile, unsplit launches (one program per sequence)
    num_warps: int = 4
    num_stages: int = 3
    # Split launches run many short programs per SM: smaller tiles, two warps and a
    # deeper pipeline keep more loads in flight (H200 sweep, docs/BENCHMARKS.md: batch
    # 24 x 3.7K keys 69% -> 80% of copy bandwidth). Unsplit launches (batch >= 128)
    # keep the larger tile above, which measured 105% there against 85%.
    split_block_n: int = 32
    split_num_warps: int = 2
    split_num_stages: int = 4
    waves: int = 4               # aim for waves * SM count programs
    # Never split below this many keys. Short splits pay off at small batches:
    # one program walking a few hundred keys is latency-bound (H200, batch 1).
    min_split_keys: int = 128
    num_splits: int | None = None  # fixed split count (bench sweeps); None = heuristic

    @staticmethod
    def uniform(block_n: int, num_warps: int, num_stages: int, **kw) -> "DecodeConfig":
        """One tile config for split and unsplit launches alike (bench sweeps)."""
        return DecodeConfig(block_n, num_warps, num_stages, block_n, num_warps, num_stages, **kw)

    def tile(self, num_splits: int) -> tuple[int, int, int]:
        """(keys per tile, warps, pipeline stages) for a launch of `num_splits`."""
        if num_splits == 1:
            return self.block_n, self.num_warps, self.num_stages
        return self.split_block_n, self.split_num_warps, self.split_num_stages


@triton.jit
def _query_len(query_start_loc_ptr, seq):
    return tl.load(query_start_loc_ptr + seq + 1) - tl.load(query_start_loc_ptr + seq)


@triton.jit
def _attend_cached(q, k_cache_ptr, v_cache_ptr, start, end, sink_end, lo, table_row,
                   stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale,
                   BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of the query rows over cached keys [start, end):
    (running max, running sum, unnormalised output), in log2 units."""
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for tile in range(start, end, BLOCK_N):
        _, key_valid, v_ptrs, s = score_tile(
            q, k_cache_ptr, v_cache_ptr, tile + tl.arange(0, BLOCK_N), end, sink_end, lo,
            table_row, stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale,
            HEAD_DIM, PAGE_SIZE, DOT_PRECISION)
        s = tl.where(key_valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_tile(s, m_i, l_i, acc, v_ptrs, key_valid, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attend_newest(q, k_new, v_new, m_i, l_i, acc, qk_scale, owns):
    """Fold one more key (the step's own, from registers) into the online
    softmax; a no-op unless `owns`."""
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
    s_new = tl.where(owns, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m_i - m_new))
    p_new = tl.where(owns, tl.exp2(s_new - m_new), 0.0)
    l_i = l_i * alpha + p_new
    p_new = p_new.to(v_new.dtype).to(tl.float32)  # rounded like the tile loop's p
    acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
    return m_new, l_i, acc


# The block table's width (its row stride) changes from batch to batch; left
# to specialise, each new divisibility class compiles the kernel anew while a
# live server waits (seen as 0.4 s of Triton compiles in a served run's profile).
@triton.jit
def _attend_and_store_newest(q, m_i, l_i, acc, qk_scale, owns_newest, token, kv_head,
                             k_new_ptr, v_new_ptr, slot_mapping_ptr, stride_kt, stride_kh, stride_vt,
                             stride_vh, k_cache_ptr, v_cache_ptr, stride_cache_block, stride_cache_offset,
                             kv_head_offset, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The step's own key and value from k_new/v_new: attended by the split that owns them
    (`owns_newest`), which also stores them into the cache slot (slot < 0: a graph's padding row)."""
    dims = tl.arange(0, HEAD_DIM)
    k_new = tl.load(k_new_ptr + token * stride_kt + kv_head * stride_kh + dims)
    v_new = tl.load(v_new_ptr + token * stride_vt + kv_head * stride_vh + dims)
    k_new = k_new.to(k_cache_ptr.dtype.element_ty)
    v_new = v_new.to(v_cache_ptr.dtype.element_ty)
    m_i, l_i, acc = _attend_newest(q, k_new, v_new, m_i, l_i, acc, qk_scale, owns_newest)
    slot = tl.load(slot_mapping_ptr + token)
    if owns_newest & (slot >= 0):
        dst = ((slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_offset
               + kv_head_offset + dims)
        tl.store(k_cache_ptr + dst, k_new)
        tl.store(v_cache_ptr + dst, v_new)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_table", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, block_table_ptr,
    query_start_loc_ptr, seq_lens_ptr, qk_scale, window, sink,
    stride_qt, stride_qh, stride_table,
    stride_cache_block, stride_cache_offset, stride_cache_head, num_splits,
    k_new_ptr, v_new_ptr, slot_mapping_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    out_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WRITE_NEW: tl.constexpr, DIRECT: tl.constexpr,
    SINGLE_ONLY: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if SINGLE_ONLY:  # a mixed batch: the varlen kernel owns every longer query
        if _query_len(query_start_loc_ptr, seq) != 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    lo, sink_end = visible_range(seq_len - 1, window, sink, SLIDING)
    num_keys = sink_end + seq_len - lo
    start, end = split_range(num_keys, split, num_splits, BLOCK_N)
    q, head, row_valid = group_queries(q_ptr, token, kv_head, stride_qt, stride_qh, k_cache_ptr,
                                       GROUP, BLOCK_G, HEAD_DIM)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table
    kv_head_offset = kv_head * stride_cache_head
    # The newest key (virtual index num_keys - 1) is this step's own token.
    # With WRITE_NEW it comes from k_new/v_new, not the cache: the tile loop
    # stops before it (a select between a tile's load and its dot would break
    # the loads' software pipelining) and the split that owns it adds it
    # afterwards and stores it into the cache. No other program reads that
    # slot in this launch, so no separate cache-write kernel runs before us.
    newest = num_keys - 1
    cached_end = end
    if WRITE_NEW:
        cached_end = tl.minimum(end, newest)
    m_i, l_i, acc = _attend_cached(
        q, k_cache_ptr, v_cache_ptr, start, cached_end, sink_end, lo, table_row,
        stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale,
        BLOCK_G, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_PRECISION)
    if WRITE_NEW:
        m_i, l_i, acc = _attend_and_store_newest(
            q, m_i, l_i, acc, qk_scale, (start <= newest) & (newest < end), token, kv_head,
            k_new_ptr, v_new_ptr, slot_mapping_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
            k_cache_ptr, v_cache_ptr, stride_cache_block, stride_cache_offset, kv_head_offset,
            HEAD_DIM, PAGE_SIZE)
    store_split(out_ptr, part_out_ptr, part_lse_ptr, m_i, l_i, acc, token, seq, head, row_valid,
                split, num_splits, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, DIRECT)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, stride_ot, stride_oh,
    num_splits, NUM_HEADS: tl.constexpr, SPLITS_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr, SINGLE_ONLY: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if SINGLE_ONLY:
        if _query_len(query_start_loc_ptr, seq) != 1:
            return
    row = (seq * NUM_HEADS + head).to(tl.int64) * num_splits
    out = merge_splits(part_out_ptr, part_lse_ptr, row, num_splits, SPLITS_POW2, HEAD_DIM)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + tl.arange(0, HEAD_DIM),
             out.to(out_ptr.dtype.element_ty))


@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: any small number exercises the splits
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def plan_splits(num_seqs: int, num_kv_heads: int, max_keys: int, num_sms: int,
                config: DecodeConfig) -> int:
    """Programs per (sequence, KV head): enough for `waves` waves over the SMs,
    but no split shorter than `min_split_keys` at the longest context."""
    tiles = max(1, triton.cdiv(max_keys, config.split_block_n))
    if config.num_splits is not None:
        wanted = config.num_splits
    else:
        wanted = triton.cdiv(config.waves * num_sms, num_seqs * num_kv_heads)
        wanted = min(wanted, max(1, max_keys // config.min_split_keys))
    return max(1, min(wanted, tiles, MAX_SPLITS))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                     block_table: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                     window: int | None, sink: int,
                     config: DecodeConfig = DecodeConfig(),
                     new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     single_only: bool = False) -> torch.Tensor:
    """q/out: [num_seqs, H, D], one query per sequence.

    Without `new_kv` the cache already holds every key, the step's own
    included. With `new_kv = (k, v, slot_mapping)` ([num_seqs, KVH, D] twice,
    [num_seqs] int64) the step's own key comes from k/v and is written to the
    cache by this launch (fusing the cache write); a negative slot skips it.

    `single_only`: q/out are a mixed batch's [T, H, D]; only the sequences
    with exactly one query are attended (their output rows written), the
    others are left to the varlen kernel (`prefill_attention(single_queries=False)`).
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    max_keys = max_seq_len if window is None else min(max_seq_len, window + sink)
    num_splits = plan_splits(num_seqs, num_kv_heads, max_keys, sm_count(q.device), config)
    direct = num_splits == 1
    block_n, num_warps, num_stages = config.tile(num_splits)
    # Direct launches never touch the partials: one dummy element stands in.
    part_shape = (1,) if direct else (num_seqs, num_heads, num_splits, head_dim)
    part_out = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(part_shape[:3], dtype=torch.float32, device=q.device)
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, seq_lens)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, part_out, part_lse, block_table,
        query_start_loc, seq_lens, scale * LOG2E, window or 0, sink,
        q.stride(0), q.stride(1), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), num_splits,
        k_new, v_new, slots, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=kv_cache.shape[2], BLOCK_N=block_n,
        SLIDING=window is not None, DOT_PRECISION=dot_precision(kv_cache.dtype),
        WRITE_NEW=new_kv is not None, DIRECT=direct, SINGLE_ONLY=single_only,
        num_warps=num_warps, num_stages=num_stages)
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, query_start_loc, out.stride(0), out.stride(1),
            num_splits, NUM_HEADS=num_heads,
            SPLITS_POW2=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim,
            SINGLE_ONLY=single_only)
    return out
