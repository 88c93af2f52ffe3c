"""Decode attention over a work list: split-KV where each sequence takes its own split count.

The decode kernel (`decode.py`) cuts every sequence of a launch into the same number of
splits, planned for the longest context (under a CUDA graph, for the bucket's bound). Served
contexts are skewed, ide-completion's files running from ~200 to ~2,500 tokens, so a long
context's programs walk several times the keys of the rest while the GPU waits for them. One
layer at 24 rows of the workload's contexts took 36.1 us against 32.9 with equal contexts of
the same total keys (H200, 2026-12-04, docs/BENCHMARKS.md).

Here the host cuts the batch's keys into chunks of one length: the keys spread over `waves` x
SMs programs for each KV head, at least `min_split_keys` each (`plan_work`). Each sequence takes
as many splits as its keys fill chunks (its keys cut evenly over them), and the host lists the
(sequence, split) items. The grid is (list capacity, KV heads), so no program idles but the
list's padding. An earlier try computed the same split lengths on the device, over a split axis
wide enough for the longest context. Its idle programs and per-program sums lost at equal
contexts (1.19-1.44x) and gained nothing served, so it was removed (d840067).

A sequence with one split writes its output itself; the reduce merges the others'
partials, laid out [head, item]. Full attention only: a sliding window bounds its keys, and
even splits serve it.

CUDA graphs: `DecodeWork` views one int32 buffer, which the host rewrites whole before each
replay (`DecodeGraphs`; `MixedGraphs` for its one-query rows, whose even plan is made for the
graph's sequence capacity and so gives each row one split). Entries past the step's items hold
sequence -1, and their programs exit.
On by default; `KVSERVE_DECODE_WORK=0` keeps the even split (decode.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvserve.attention.kernels.common import (dot_precision, env_switch, group_queries, merge_splits, split_range,
                                              store_split)
from kvserve.attention.kernels.decode import (LOG2E, DecodeConfig, _attend_and_store_newest, _attend_cached,
                                              sm_count)

ENV = "KVSERVE_DECODE_WORK"
MAX_SEQ_SPLITS = 16   # a sequence's splits: the reduce loads them at once


def enabled_by_env() -> bool:
    """On unless KVSERVE_DECODE_WORK=0: decode graphs and mixed graphs' one-query rows of
    full-attention layers run the work list."""
    return env_switch(ENV, default=True)


def programs_per_head(num_kv_heads: int, num_sms: int, config: DecodeConfig = DecodeConfig()) -> int:
    return max(1, config.waves * num_sms // num_kv_heads)


def capacity(num_seqs: int, num_kv_heads: int, num_sms: int, config: DecodeConfig = DecodeConfig()) -> int:
    """Items a launch of `num_seqs` can list: one a sequence plus one a chunk (`plan_work`)."""
    return num_seqs + programs_per_head(num_kv_heads, num_sms, config)


def plan_work(keys: np.ndarray, num_kv_heads: int, num_sms: int, cap: int,
              config: DecodeConfig = DecodeConfig()) -> np.ndarray:
    """The launch's work list for sequences of `keys` keys each, as one int32 array laid out
    as `DecodeWork` views it: item sequence and item split ([cap] each, sequence -1 past the
    items), then each sequence's split count and first item ([len(keys)] each). A sequence of
    0 keys gets no item and reads as one split, so the reduce leaves it too (a mixed batch's
    prompt rows, which the varlen kernel writes)."""
    return work_layout(plan_splits(keys, num_kv_heads, num_sms, cap, config), cap)


def plan_splits(keys: np.ndarray, num_kv_heads: int, num_sms: int, cap: int,
                config: DecodeConfig = DecodeConfig()) -> np.ndarray:
    """`plan_work`'s split count a sequence (`split_counts` of the keys, negatives as 0)."""
    return split_counts(np.asarray(keys, dtype=np.int64).clip(0), num_kv_heads, num_sms, cap, config)


def work_layout(splits: np.ndarray, cap: int) -> np.ndarray:
    """`plan_work`'s array for sequences of `splits` splits each (0: no item): it depends on
    these two alone, so a caller holding the list of equal ones need not rewrite it."""
    first = np.cumsum(splits) - splits
    items = int(splits.sum())
    work = np.zeros(2 * cap + 2 * len(splits), dtype=np.int32)
    work[:cap] = -1
    work[:items] = np.repeat(np.arange(len(splits)), splits)
    work[cap:cap + items] = np.arange(items) - np.repeat(first, splits)
    work[2 * cap:2 * cap + len(splits)] = np.maximum(splits, 1)
    work[2 * cap + len(splits):] = first
    return work


def split_counts(keys: np.ndarray, num_kv_heads: int, num_sms: int, cap: int, config: DecodeConfig) -> np.ndarray:
    """Each sequence's splits: as many as its keys fill chunks of the launch's one length (its
    keys over the programs a KV head, at least min_split_keys, whole tiles), at most
    MAX_SEQ_SPLITS, and no more items in all than `cap` (longer chunks until they fit)."""
    if cap < np.count_nonzero(keys):
        raise ValueError(f"a work list of capacity {cap} cannot hold {np.count_nonzero(keys)} sequences")
    chunk = max(config.min_split_keys, -(-int(keys.sum()) // programs_per_head(num_kv_heads, num_sms, config)))
    chunk = -(-chunk // config.split_block_n) * config.split_block_n
    while True:
        splits = np.minimum(-(-keys // chunk), MAX_SEQ_SPLITS)
        if splits.sum() <= cap:   # always, at `capacity`'s cap
            return splits
        chunk *= 2


@dataclass(frozen=True)
class DecodeWork:
    """Device views of a work list (`plan_work`'s layout) over one int32 buffer."""
    item_seq: torch.Tensor
    item_split: torch.Tensor
    seq_splits: torch.Tensor
    seq_first: torch.Tensor

    @staticmethod
    def views(buffer: torch.Tensor, num_seqs: int, cap: int) -> "DecodeWork":
        return DecodeWork(buffer[:cap], buffer[cap:2 * cap], buffer[2 * cap:2 * cap + num_seqs],
                          buffer[2 * cap + num_seqs:2 * cap + 2 * num_seqs])

    @property
    def capacity(self) -> int:
        return self.item_seq.shape[0]


@triton.jit(do_not_specialize=["stride_table", "cap"])
def _work_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, block_table_ptr,
    query_start_loc_ptr, seq_lens_ptr, item_seq_ptr, item_split_ptr, seq_splits_ptr, cap, qk_scale,
    stride_qt, stride_qh, stride_table, stride_cache_block, stride_cache_offset, stride_cache_head,
    k_new_ptr, v_new_ptr, slot_mapping_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    out_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, WRITE_NEW: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(item_seq_ptr + item)
    if seq < 0:   # past the step's items
        return
    split = tl.load(item_split_ptr + item)
    num_splits = tl.load(seq_splits_ptr + seq)
    num_keys = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    start, end = split_range(num_keys, split, num_splits, BLOCK_N)
    q, head, row_valid = group_queries(q_ptr, token, kv_head, stride_qt, stride_qh, k_cache_ptr,
                                       GROUP, BLOCK_G, HEAD_DIM)
    kv_head_offset = kv_head * stride_cache_head
    newest = num_keys - 1   # with WRITE_NEW the step's own key comes from k_new (decode.py)
    cached_end = end
    if WRITE_NEW:
        cached_end = tl.minimum(end, newest)
    zero = num_keys * 0
    m_i, l_i, acc = _attend_cached(
        q, k_cache_ptr, v_cache_ptr, start, cached_end, zero, zero, block_table_ptr + seq.to(tl.int64) * stride_table,
        stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale, BLOCK_G, HEAD_DIM, PAGE_SIZE, BLOCK_N,
        DOT_PRECISION)
    if WRITE_NEW:
        m_i, l_i, acc = _attend_and_store_newest(
            q, m_i, l_i, acc, qk_scale, (start <= newest) & (newest < end), token, kv_head,
            k_new_ptr, v_new_ptr, slot_mapping_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
            k_cache_ptr, v_cache_ptr, stride_cache_block, stride_cache_offset, kv_head_offset, HEAD_DIM, PAGE_SIZE)
    if num_splits == 1:   # the sequence's output, no reduce
        store_split(out_ptr, part_out_ptr, part_lse_ptr, m_i, l_i, acc, token, 0, head, row_valid,
                    item, cap, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, True)
    else:   # partial row head * cap + item
        store_split(out_ptr, part_out_ptr, part_lse_ptr, m_i, l_i, acc, token, 0, head, row_valid,
                    item, cap, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, False)


@triton.jit(do_not_specialize=["cap"])
def _work_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, seq_splits_ptr, seq_first_ptr,
                        cap, stride_ot, stride_oh, SPLITS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_splits = tl.load(seq_splits_ptr + seq)
    if num_splits == 1:   # written by its one split
        return
    first_row = head.to(tl.int64) * cap + tl.load(seq_first_ptr + seq)
    out = merge_splits(part_out_ptr, part_lse_ptr, first_row, num_splits, SPLITS_POW2, HEAD_DIM)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + tl.arange(0, HEAD_DIM), out.to(out_ptr.dtype.element_ty))


def work_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, work: DecodeWork,
                          config: DecodeConfig = DecodeConfig(),
                          new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`decode_attention` of full-attention layers (no window, no sink) over `work`, the list
    `plan_work` made for these sequences' key counts (one query each)."""
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    cap = work.capacity
    block_n, num_warps, num_stages = config.tile(2)
    part_out = torch.empty((num_heads, cap, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_heads, cap), dtype=torch.float32, device=q.device)
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, seq_lens)
    _work_kernel[(cap, num_kv_heads)](
        q, kv_cache[0], kv_cache[1], part_out, part_lse, block_table, query_start_loc, seq_lens,
        work.item_seq, work.item_split, work.seq_splits, cap, scale * LOG2E,
        q.stride(0), q.stride(1), block_table.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        k_new, v_new, slots, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=kv_cache.shape[2], BLOCK_N=block_n, DOT_PRECISION=dot_precision(kv_cache.dtype),
        WRITE_NEW=new_kv is not None, num_warps=num_warps, num_stages=num_stages)
    _work_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, query_start_loc, work.seq_splits, work.seq_first, cap, out.stride(0), out.stride(1),
        SPLITS_POW2=MAX_SEQ_SPLITS, HEAD_DIM=head_dim)
    return out


def device_work(keys: np.ndarray, num_kv_heads: int, device: torch.device,
                config: DecodeConfig = DecodeConfig()) -> DecodeWork:
    """An eager launch's work list (tests, benchmarks): planned and uploaded at once."""
    sms = sm_count(torch.device(device))
    cap = capacity(len(keys), num_kv_heads, sms, config)
    buffer = torch.from_numpy(plan_work(keys, num_kv_heads, sms, cap, config)).to(device)
    return DecodeWork.views(buffer, len(keys), cap)
