"""Pieces shared by the prefill and decode kernels.

Visible keys are walked in a "virtual" index j: the sink keys [0, sink_end)
first, then the window keys [lo, hi). Only those keys are ever loaded, so a
sliding-window layer costs O(window + sink) per query tile and the NULL
blocks that replace out-of-window pages are never read.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os

import triton
import triton.language as tl

logger = logging.getLogger(__name__)


def env_switch(name: str, default: bool = False) -> bool:
    """A switch: "0" off, "1" on, unset `default`; any other value is refused by name."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


@functools.cache
def optional_gluon_module(name: str, fallback: str):
    """The Gluon kernel module `name`, or None (logged once, with what runs instead: `fallback`)
    where this Triton lacks the Gluon Hopper API the module is written against."""
    try:
        return importlib.import_module(name)
    except (ImportError, AttributeError) as e:
        logger.info("Gluon kernel %s unavailable (%s): %s", name.rsplit(".", 1)[-1], e, fallback)
        return None


def dot_precision(dtype) -> str:
    """float32 caches get exact (ieee) dots, so fp32 runs match a float32
    reference token for token; half types use the tensor cores as they are."""
    import torch
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def visible_range(first_pos, window, sink, SLIDING: tl.constexpr):
    """(lo, sink_end) for a query tile whose earliest query is at first_pos."""
    if SLIDING:
        lo = tl.maximum(first_pos - window + 1, 0)
        sink_end = tl.minimum(sink, lo)
    else:
        lo = first_pos * 0
        sink_end = first_pos * 0
    return lo, sink_end


@triton.jit
def group_queries(q_ptr, token, kv_head, stride_qt, stride_qh, cache_ptr, GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A decode query's GROUP heads that share `kv_head`, as the BLOCK_G rows of a tl.dot in the
    cache's dtype (rows past GROUP zero): (q, their head indices, row validity)."""
    rows = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    return q.to(cache_ptr.dtype.element_ty), head, row_valid


@triton.jit
def split_range(num_keys, split, num_splits, BLOCK_N: tl.constexpr):
    """[start, end) of this split's keys (virtual indices). Each program
    divides its own keys evenly over the splits: the grid is planned for the
    longest context (in a CUDA graph, for the bucket's bound), and a fixed
    split length would leave shorter contexts on a few programs."""
    split_len = tl.cdiv(tl.cdiv(num_keys, BLOCK_N), num_splits) * BLOCK_N
    start = split * split_len
    return start, tl.minimum(num_keys, start + split_len)


@triton.jit
def page_offsets(j, num_keys, sink_end, lo, block_table_row_ptr,
                 stride_cache_block, stride_cache_offset, kv_head_offset,
                 PAGE_SIZE: tl.constexpr):
    """Key positions and cache element offsets of virtual indices j."""
    key = tl.where(j < sink_end, j, j - sink_end + lo)
    valid = j < num_keys
    page = tl.load(block_table_row_ptr + key // PAGE_SIZE, mask=valid, other=0)
    offsets = (page.to(tl.int64) * stride_cache_block
               + (key % PAGE_SIZE) * stride_cache_offset + kv_head_offset)
    return key, valid, offsets


@triton.jit
def score_tile(q, k_cache_ptr, v_cache_ptr, j, num_keys, sink_end, lo, block_table_row_ptr,
               stride_cache_block, stride_cache_offset, kv_head_offset, qk_scale,
               HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile at virtual indices j: key positions, validity, the V row
    pointers for `online_softmax_tile`, and the unmasked scores q·K (log2
    units). Each kernel applies its own mask to the scores."""
    dims = tl.arange(0, HEAD_DIM)
    key, key_valid, kv_offs = page_offsets(
        j, num_keys, sink_end, lo, block_table_row_ptr, stride_cache_block,
        stride_cache_offset, kv_head_offset, PAGE_SIZE)
    k = tl.load(k_cache_ptr + kv_offs[:, None] + dims[None, :], mask=key_valid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    return key, key_valid, v_cache_ptr + kv_offs[:, None] + dims[None, :], s


@triton.jit
def online_softmax_tile(s, m_i, l_i, acc, v_ptrs, key_valid, DOT_PRECISION: tl.constexpr):
    """Fold one tile of masked scores `s` (log2 units) into the running max,
    sum and unnormalised output. The tile's V rows are loaded here, after the
    softmax, where both kernels' loops always loaded them."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=key_valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_split(out_ptr, part_out_ptr, part_lse_ptr, m_i, l_i, acc, token, part_index, head, row_valid,
                split, num_splits, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, DIRECT: tl.constexpr):
    """Rows' final output at query `token` (DIRECT: one split, no reduce), or
    this split's normalised partial and its log2-sum-exp at partial row
    (part_index, head, split) of [*, NUM_HEADS, num_splits, HEAD_DIM].
    `token` and `part_index` are per row or one for all rows."""
    dims = tl.arange(0, HEAD_DIM)
    has_keys = l_i > 0  # an empty split (past a row's keys) merges as weight 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if DIRECT:
        out_offs = token * stride_ot + head * stride_oh
        tl.store(out_ptr + out_offs[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None])
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part_row = (part_index * NUM_HEADS + head).to(tl.int64) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_valid[:, None])
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)


@triton.jit
def merge_splits(part_out_ptr, part_lse_ptr, first_row, num_splits, SPLITS_POW2: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """One (row, head)'s output [HEAD_DIM] in float32 from its splits' partials
    (`store_split`), each weighted by its softmax mass; an empty split
    (log2-sum-exp -inf) weighs 0. Every split is loaded at once."""
    splits = tl.arange(0, SPLITS_POW2)
    split_valid = splits < num_splits
    rows = first_row + splits
    lse = tl.load(part_lse_ptr + rows, mask=split_valid, other=float("-inf"))
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.max(lse, 0)))
    part = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :],
                   mask=split_valid[:, None], other=0.0)
    return tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
