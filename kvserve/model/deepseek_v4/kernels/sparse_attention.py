"""V4 sparse attention for prefill, chunked prefill and decode alike: a query
token attends to its sliding-window keys plus its compressed entries (CSA:
the indexer's chosen entries; HCA: every entry whose window has closed), with
one sink logit per head in the softmax.

K = V (one shared head): a program holds all query heads of one token as the
rows of its tiles, so each key row (head_dim values) is loaded once and feeds
both q.K^T and P.V. A token's keys are walked in one virtual index, window
keys first, then compressed ones; split-KV divides that range over
`num_splits` programs (few tokens, long entry lists: decode), each writing a
normalised partial and its log2-sum-exp, merged by a reduce. Split 0 carries
the sink (a logit with a zero value row), so no split is ever empty of
weight and padding tokens (sequence -1) come out as zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.attention.kernels.common import dot_precision
from kvserve.model.deepseek_v4.kernels.pages import PageRef, V4PagedBatch, entry_rows, sm_count, token_rows

LOG2E = 1.4426950408889634
_LOG2E_IN_KERNEL = tl.constexpr(LOG2E)
MAX_SPLITS = 32


@dataclass(frozen=True)
class SparseAttentionConfig:
    block_n: int = 32        # keys per tile
    num_warps: int = 8       # 64 heads x 512 dims of fp32 accumulator: 128 registers a thread at 8 warps
    num_stages: int = 2
    # Split-KV aims at this many programs per SM. A split costs a partial
    # write + read (heads x head_dim x 8 bytes per token), so splits are
    # kept for launches that would leave most SMs idle.
    waves: float = 0.5
    min_split_keys: int = 128  # never split below this many keys
    num_splits: int | None = None  # fixed split count (bench sweeps); None = the heuristic


def plan_splits(num_tokens: int, max_keys: int, num_sms: int, config: SparseAttentionConfig) -> int:
    """Programs per token: enough to cover `waves` x SMs, no split shorter
    than `min_split_keys` at the longest key list."""
    tiles = max(1, triton.cdiv(max_keys, config.block_n))
    if config.num_splits is not None:
        wanted = config.num_splits
    else:
        wanted = triton.cdiv(max(1, int(config.waves * num_sms)), max(num_tokens, 1))
        wanted = min(wanted, max(1, max_keys // config.min_split_keys))
    return max(1, min(wanted, tiles, MAX_SPLITS))


@triton.jit
def _key_rows(j, end, num_window, pos, unit, sliding_row_ptr, sliding_offset, sliding_width, entry_row_ptr,
              entry_offset, entry_width, index_row_ptr, RATE: tl.constexpr, PAGE_SIZE: tl.constexpr,
              IS_CSA: tl.constexpr):
    """Storage offsets and validity of the keys at virtual indices j < end."""
    valid = j < end
    in_window = j < num_window
    rows = token_rows(sliding_row_ptr, pos - num_window + 1 + j, valid & in_window, unit, sliding_offset,
                      sliding_width, PAGE_SIZE)
    if RATE > 0:  # (not an early return for RATE 0: the compiler would still build the code after it)
        compressed = j - num_window
        if IS_CSA:
            entry = tl.load(index_row_ptr + compressed, mask=valid & ~in_window, other=-1)
            valid &= in_window | (entry >= 0)
        else:
            entry = compressed
        entry_rows_ = entry_rows(entry_row_ptr, entry, valid & ~in_window, unit, entry_offset, entry_width, RATE,
                                 PAGE_SIZE)
        # A blend, not tl.where: the compiler's alignment analysis gives up on a
        # select of offsets, and the key loads would fall back to 2-byte accesses.
        pick = in_window.to(tl.int64)
        rows = rows * pick + entry_rows_ * (1 - pick)
    return rows, valid


@triton.jit
def _key_counts(seq, pos, window, topk, RATE: tl.constexpr, IS_CSA: tl.constexpr):
    """(window keys, all keys) of the token at `pos`; none for a padding token (seq -1)."""
    real = seq >= 0
    num_window = tl.where(real, tl.minimum(pos + 1, window), 0)
    if RATE > 0:
        num_compressed = tl.where(real, (pos + 1) // RATE, 0)
    else:
        num_compressed = tl.zeros([], tl.int32)
    if IS_CSA:
        num_compressed = tl.minimum(num_compressed, topk)  # chosen entries come first in the index row
    return num_window, num_window + num_compressed


@triton.jit
def _store_split(out_ptr, stride_ot, stride_oh, part_out_ptr, part_lse_ptr, m_i, l_i, acc, t, split,
                 num_splits, heads, head_mask, num_heads, HEAD_DIM: tl.constexpr):
    """The output (one split) or this split's normalised partial and log2-sum-exp."""
    dims = tl.arange(0, HEAD_DIM)
    has_weight = l_i > 0
    out = acc / tl.where(has_weight, l_i, 1.0)[:, None]
    if num_splits == 1:
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:
        lse = tl.where(has_weight, m_i + tl.log2(tl.where(has_weight, l_i, 1.0)), float("-inf"))
        part_row = (t.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], out, mask=head_mask[:, None])
        tl.store(part_lse_ptr + part_row, lse, mask=head_mask)


@triton.jit(do_not_specialize=["sliding_stride_table", "entry_stride_table", "num_splits", "topk", "window"])
def _sparse_attention_kernel(
        q_ptr, stride_qt, stride_qh, storage_ptr, unit,
        sliding_offset, sliding_width, sliding_table, sliding_stride_table,
        entry_offset, entry_width, entry_table, entry_stride_table,
        index_ptr, stride_it, sink_ptr, seq_idx_ptr, pos_ptr, qk_scale, window, topk,
        out_ptr, stride_ot, stride_oh, part_out_ptr, part_lse_ptr, num_splits, num_heads,
        RATE: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr, IS_CSA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    t = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.load(seq_idx_ptr + t)
    pos = tl.load(pos_ptr + t).to(tl.int32)
    num_window, num_keys = _key_counts(seq, pos, window, topk, RATE, IS_CSA)
    split_len = tl.cdiv(tl.cdiv(num_keys, BLOCK_N), num_splits) * BLOCK_N
    start = split * split_len
    end = tl.minimum(num_keys, start + split_len)

    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None], other=0.0).to(storage_ptr.dtype.element_ty)
    sink = tl.load(sink_ptr + heads, mask=head_mask, other=0.0) * _LOG2E_IN_KERNEL
    # Split 0 starts from the sink: a logit whose value row is zero. -1e30, not
    # -inf, elsewhere: a tile without a valid key then rescales by 1, not NaN.
    m_i = tl.where(split == 0, sink, -1.0e30)
    l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    row = tl.maximum(seq, 0).to(tl.int64)
    sliding_row_ptr = sliding_table + row * sliding_stride_table
    entry_row_ptr = entry_table + row * entry_stride_table
    index_row_ptr = index_ptr + t.to(tl.int64) * stride_it
    for j0 in range(start, end, BLOCK_N):
        rows, valid = _key_rows(j0 + tl.arange(0, BLOCK_N), end, num_window, pos, unit, sliding_row_ptr,
                                sliding_offset, sliding_width, entry_row_ptr, entry_offset, entry_width,
                                index_row_ptr, RATE, PAGE_SIZE, IS_CSA)
        k = tl.load(storage_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=DOT_PRECISION)
        m_i = m_new
    _store_split(out_ptr, stride_ot, stride_oh, part_out_ptr, part_lse_ptr, m_i, l_i, acc, t, split,
                 num_splits, heads, head_mask, num_heads, HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_splits, num_heads,
                   SPLITS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    split_mask = splits < num_splits
    row = (t.to(tl.int64) * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + row + splits, mask=split_mask, other=float("-inf"))
    weight = tl.where(split_mask, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    part = tl.load(part_out_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
                   mask=split_mask[:, None], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def _max_keys(batch: V4PagedBatch, window: int, rate: int, topk: int | None) -> int:
    entries = batch.max_seq_len // rate if rate else 0
    return min(window, batch.max_seq_len) + (min(entries, topk) if topk is not None else entries)


def sparse_attention(q: torch.Tensor, sliding: PageRef, entries: PageRef | None, indices: torch.Tensor | None,
                     sinks: torch.Tensor, scale: float, window: int, rate: int, batch: V4PagedBatch,
                     out: torch.Tensor, config: SparseAttentionConfig = SparseAttentionConfig()) -> torch.Tensor:
    """out [T, H, D] = attention of q [T, H, D] over each token's window keys
    (sliding pages) and compressed entries (entry pages, first D columns of a
    row): all visible ones, or with `indices` [T, >= topk] int32 (CSA) the
    chosen ones, listed first in each row with -1 after them. `rate` 0 and
    no `entries`: a sliding-only layer. sinks [H] float32."""
    num_tokens, num_heads, head_dim = q.shape
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton V4 attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if (entries is None) != (rate == 0):
        raise ValueError(f"sparse_attention: entry pages and a compress rate come together, got rate {rate}")
    if num_tokens == 0:
        return out
    topk = indices.shape[1] if indices is not None else None
    num_splits = plan_splits(num_tokens, _max_keys(batch, window, rate, topk), sm_count(q.device), config)
    part_shape = (1,) if num_splits == 1 else (num_tokens, num_heads, num_splits, head_dim)
    part_out = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(part_shape[:3], dtype=torch.float32, device=q.device)
    pages = entries if entries is not None else PageRef(sliding.table, 0, 1, 0)
    index = indices if indices is not None else batch.seq_idx[:, None]  # never read without indices
    _sparse_attention_kernel[(num_tokens, num_splits)](
        q, q.stride(0), q.stride(1), batch.storage, batch.storage.stride(0),
        sliding.offset, sliding.width, sliding.table, sliding.table.stride(0),
        pages.offset, pages.width, pages.table, pages.table.stride(0),
        index, index.stride(0), sinks, batch.seq_idx, batch.positions, scale * LOG2E, window, topk or 0,
        out, out.stride(0), out.stride(1), part_out, part_lse, num_splits, num_heads,
        RATE=rate, PAGE_SIZE=batch.block_size, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_N=config.block_n,
        IS_CSA=indices is not None, DOT_PRECISION=dot_precision(batch.storage.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages)
    if num_splits > 1:
        _reduce_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_splits, num_heads,
            SPLITS_POW2=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim)
    return out
