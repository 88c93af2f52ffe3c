"""Shared-prefix (cascade) decode attention: a prefix that several running sequences share is
read once per step for all of them, not once per sequence.

Under ide-completion load, decode rows that share a file prefix (~700 tokens, the same cached
blocks) each read it again every step; the plain decode kernel (`decode.py`) attends one
sequence per program. Here a step's decode attention runs in three launches:
- the prefix kernel: one program per (group, KV head, prefix split) loads the group's shared
  prefix tiles once and attends every member's query heads over them (rows = members x the
  GQA group), writing each member's partial (normalised output and log2-sum-exp);
- the suffix kernel: one program per (sequence, KV head, split) attends the sequence's keys past
  its group's prefix (all its keys when it is in no group) into further partial slots, and a
  sequence in no group writes its prefix slots empty, so every slot is rewritten every step;
  with `new_kv` it also takes the step's own key from the step's K/V and writes it to the cache,
  as the decode kernel does (a prefix never reaches a sequence's last key);
- the decode kernel's reduce (`decode._decode_reduce_kernel`) merges the partials.
`plan_groups` builds the groups on the host from the block tables: sequences whose leading
blocks are the same block ids, at least two a group, at most MAX_MEMBERS (a larger set becomes
several groups), the prefix cut to whole pages that end before each member's last key.

Off by default (`KVSERVE_CASCADE=1` turns it on for models with one full-attention KV group; the
runner plans each decode step's groups, a decode graph rewrites `CascadeBuffers` before each
replay). On an H200 (`benchmarks/cascade_decode_probe.py`, 2026-12-04) it lost to the plain decode
kernel at ide-completion's sharing (Zipf over 48 files: 1.34-1.47x its time at 24 and 51 rows)
and won only with 16 sequences a prefix (0.76-0.89x): the plain kernel already reads a shared
prefix mostly from L2 (32.7 us a layer at 24 rows under Zipf sharing against 35.5 with none).
Full attention only (no sliding window, no sink keys).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvserve.attention.kernels.common import dot_precision, env_switch, group_queries, split_range, store_split
from kvserve.attention.kernels.decode import (LOG2E, DecodeConfig, _attend_and_store_newest, _attend_cached,
                                              _decode_reduce_kernel, plan_splits, sm_count)
from kvserve.runner.staging import upload

ENV = "KVSERVE_CASCADE"
MAX_MEMBERS = 16   # members a prefix program holds: 16 x a GQA group of 4 = 64 query rows
MAX_GRAPH_GROUPS = 32   # a graph's prefix grid: idle groups' programs cost a launch slot each
MIN_SHARED_PAGES = 2    # a group's least prefix: files that share only a header page are not one group
PREFIX_SPLITS = 4  # programs a group's prefix per KV head: ~176 keys each of a 704-token file


@dataclass
class CascadePlan:
    """One step's groups, as the kernels read them (all on the step's device):
    tables [G, W] int32 (a group's prefix blocks), lens [G] int32 (its prefix tokens),
    members [G, MAX_MEMBERS] int32 (sequence indices, -1 past the last) and skip [N] int32
    (each sequence's prefix tokens, 0 outside any group)."""
    tables: torch.Tensor
    lens: torch.Tensor
    members: torch.Tensor
    skip: torch.Tensor

    @property
    def num_groups(self) -> int:
        return self.lens.shape[0]


def as_table(rows) -> np.ndarray:
    """Block rows as a [B, W] int32 table: an array as it is, ragged lists padded with -1."""
    if isinstance(rows, np.ndarray):
        return rows
    width = max((len(r) for r in rows), default=0)
    return np.array([list(r) + [-1] * (width - len(r)) for r in rows], dtype=np.int32).reshape(len(rows), width)


def plan_groups(rows, seq_lens, page: int) -> list[tuple[list[int], int]]:
    """Groups of sequences sharing leading blocks: (member indices, prefix tokens) with at least
    two members, at most MAX_MEMBERS, a prefix of MIN_SHARED_PAGES or more whole pages that ends
    before each member's last key (so every member keeps a suffix). `rows`: a block table
    ([B, W], the host batch's) or ragged lists of block ids. The rows are sorted by their blocks
    and a group is a run of them sharing what its first two share (`_runs`): files that share
    only a header page form groups of their own, each with its whole prefix."""
    table, lens = as_table(rows), np.asarray(seq_lens)
    eligible = np.flatnonzero(lens > page * MIN_SHARED_PAGES)
    if len(eligible) < 2:
        return []
    return _runs(table, lens, eligible[np.lexsort(table[eligible].T[::-1])], page)


def _runs(table: np.ndarray, lens: np.ndarray, order: np.ndarray, page: int) -> list[tuple[list[int], int]]:
    """Groups over lexicographically sorted rows, from the pages each row shares with the next
    (`adjacent`, cut to both rows' whole pages before their last key): a group starts at a row
    that shares MIN_SHARED_PAGES or more with the next and no fewer than the next shares onwards
    (else the row belongs to no deeper run), and takes the rows sharing at least that much, up to
    MAX_MEMBERS; a run's rows share the least of its adjacent counts, as sorted rows do."""
    limits = (lens[order] - 1) // page
    width = int(limits.max())
    same = table[order[1:], :width] == table[order[:-1], :width]
    adjacent = np.minimum(np.cumprod(same, axis=1).sum(axis=1), np.minimum(limits[1:], limits[:-1])).tolist()
    groups, i, n = [], 0, len(order)
    while i < n - 1:
        depth = adjacent[i]
        if depth < MIN_SHARED_PAGES or (i + 1 < n - 1 and adjacent[i + 1] > depth):
            i += 1
            continue
        j = i + 1
        while j < n - 1 and j + 1 - i < MAX_MEMBERS and adjacent[j] >= depth:
            j += 1
        groups.append((sorted(order[i:j + 1].tolist()), depth * page))
        i = j + 1
    return groups


def enabled_by_env() -> bool:
    """KVSERVE_CASCADE=1: decode steps of a model with one full-attention KV group read shared
    prefixes once (off by default: slower than the plain kernel unless many sequences share one)."""
    return env_switch(ENV)


def graph_groups(size: int) -> int:
    """Groups a decode graph of `size` sequences plans for (a group has two members or more)."""
    return min(MAX_GRAPH_GROUPS, max(1, size // 2))


def build_plan(rows, seq_lens, page: int, device, groups: list[tuple[list[int], int]] | None = None) -> CascadePlan:
    """`plan_groups` (or `groups` already formed) as the kernels' tensors, an eager step's
    (graphs rewrite `CascadeBuffers`)."""
    groups = plan_groups(rows, seq_lens, page) if groups is None else groups
    buffers = CascadeBuffers(len(seq_lens), max(len(groups), 1), max([n // page for _, n in groups], default=1),
                             "cpu")
    buffers.write(groups, as_table(rows), len(seq_lens), page)
    plan = buffers.plan(len(seq_lens), len(groups))
    return CascadePlan(*(upload(t, torch.device(device)) for t in (plan.tables, plan.lens, plan.members, plan.skip)))


class CascadeBuffers:
    """A CUDA graph's plan: static tensors for up to `max_groups` groups of prefixes up to `width`
    blocks and `max_seqs` sequences, rewritten in full before every replay (groups past the
    step's: no prefix, no members; sequences in none: skip 0)."""

    def __init__(self, max_seqs: int, max_groups: int, width: int, device) -> None:
        self.tables = torch.zeros(max_groups, width, dtype=torch.int32, device=device)
        self.lens = torch.zeros(max_groups, dtype=torch.int32, device=device)
        self.members = torch.full((max_groups, MAX_MEMBERS), -1, dtype=torch.int32, device=device)
        self.skip = torch.zeros(max_seqs, dtype=torch.int32, device=device)

    def plan(self, num_seqs: int, num_groups: int) -> CascadePlan:
        return CascadePlan(self.tables[:num_groups], self.lens[:num_groups], self.members[:num_groups],
                           self.skip[:num_seqs])

    def write(self, groups: list[tuple[list[int], int]], table: np.ndarray, num_seqs: int, page: int,
              limit: int | None = None) -> int:
        """Rewrite the buffers for a step's `groups` over `num_seqs` rows: the first `limit` (the
        graph's planned count; default all the buffers hold) whose prefixes fit the width, the
        others' sequences ungrouped (skip 0: their suffix is all their keys); returns the count kept."""
        max_groups, width = self.tables.shape
        kept = [(m, n) for m, n in groups if n // page <= width][:min(limit or max_groups, max_groups)]
        tables = np.zeros((max_groups, width), dtype=np.int32)
        lens = np.zeros(max_groups, dtype=np.int32)
        members = np.full((max_groups, MAX_MEMBERS), -1, dtype=np.int32)
        skip = np.zeros(self.skip.shape[0], dtype=np.int32)
        for g, (chunk, prefix) in enumerate(kept):
            tables[g, :prefix // page] = table[chunk[0], :prefix // page]
            members[g, :len(chunk)] = chunk
            lens[g] = prefix
            skip[chunk] = prefix
        for dst, src in ((self.tables, tables), (self.lens, lens), (self.members, members), (self.skip, skip)):
            # pinned: a pageable source may make the host wait for the step in flight
            dst.copy_(torch.from_numpy(src).pin_memory() if dst.is_cuda else torch.from_numpy(src),
                      non_blocking=dst.is_cuda)
        return len(kept)


# An eager plan's table width changes from step to step: left to specialise, each new
# divisibility class of `stride_gt` would compile the kernel anew while a server waits.
@triton.jit(do_not_specialize=["num_parts", "stride_gt"])
def _prefix_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr,
                   tables_ptr, lens_ptr, members_ptr, stride_qt, stride_qh, stride_gt, stride_gm,
                   stride_cache_block, stride_cache_offset, stride_cache_head, num_parts, qk_scale,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_R: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   SUFFIX_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program = (group, KV head, prefix split): every member's query heads of this KV head are
    the rows; the shared prefix's keys are loaded once for all of them."""
    g = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_R)
    slot = rows // GROUP
    seq = tl.load(members_ptr + g * stride_gm + slot, mask=slot < MEMBERS, other=-1)
    row_valid = seq >= 0
    seq = tl.maximum(seq, 0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None], other=0.0).to(k_cache_ptr.dtype.element_ty)
    start, end = split_range(tl.load(lens_ptr + g), split, PREFIX_SPLITS, BLOCK_N)
    m_i, l_i, acc = _attend_cached(q, k_cache_ptr, v_cache_ptr, start, end, 0, 0, tables_ptr + g * stride_gt,
                                   stride_cache_block, stride_cache_offset, kv_head * stride_cache_head, qk_scale,
                                   BLOCK_R, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_PRECISION)
    store_split(q_ptr, part_out_ptr, part_lse_ptr, m_i, l_i, acc, token, seq, head, row_valid,
                SUFFIX_SPLITS + split, num_parts, stride_qt, stride_qh, NUM_HEADS, HEAD_DIM, False)


@triton.jit(do_not_specialize=["stride_table", "num_parts"])
def _suffix_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr,
                   block_table_ptr, seq_lens_ptr, skip_ptr, stride_qt, stride_qh, stride_table,
                   stride_cache_block, stride_cache_offset, stride_cache_head, num_parts, qk_scale,
                   k_new_ptr, v_new_ptr, slot_mapping_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SUFFIX_SPLITS: tl.constexpr,
                   PREFIX_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, WRITE_NEW: tl.constexpr):
    """Program = (sequence, KV head, split): the sequence's keys past its prefix; split 0 of a
    sequence in no group also empties its prefix slots (no memset before the step). WRITE_NEW:
    the step's own key (the last) comes from k_new/v_new, attended and stored into its cache slot
    by the split that owns it, as the decode kernel does (no prefix reaches it)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    skip = tl.load(skip_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q, head, row_valid = group_queries(q_ptr, token, kv_head, stride_qt, stride_qh, k_cache_ptr,
                                       GROUP, BLOCK_G, HEAD_DIM)
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end = split_range(seq_len - skip, split, SUFFIX_SPLITS, BLOCK_N)
    start, end = skip + start, skip + end
    newest = seq_len - 1
    cached_end = end
    if WRITE_NEW:
        cached_end = tl.minimum(end, newest)
    m_i, l_i, acc = _attend_cached(q, k_cache_ptr, v_cache_ptr, start, cached_end, 0, 0,
                                   block_table_ptr + seq.to(tl.int64) * stride_table, stride_cache_block,
                                   stride_cache_offset, kv_head * stride_cache_head, qk_scale,
                                   BLOCK_G, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_PRECISION)
    if WRITE_NEW:
        m_i, l_i, acc = _attend_and_store_newest(
            q, m_i, l_i, acc, qk_scale, (start <= newest) & (newest < end), token, kv_head, k_new_ptr, v_new_ptr,
            slot_mapping_ptr, stride_kt, stride_kh, stride_vt, stride_vh, k_cache_ptr, v_cache_ptr,
            stride_cache_block, stride_cache_offset, kv_head * stride_cache_head, HEAD_DIM, PAGE_SIZE)
    store_split(q_ptr, part_out_ptr, part_lse_ptr, m_i, l_i, acc, token, seq, head, row_valid,
                split, num_parts, stride_qt, stride_qh, NUM_HEADS, HEAD_DIM, False)
    if (split == 0) & (skip == 0):   # weight 0 and finite rows: the reduce multiplies them by 0
        for p in tl.static_range(PREFIX_SPLITS):
            part_row = (seq * NUM_HEADS + head).to(tl.int64) * num_parts + SUFFIX_SPLITS + p
            tl.store(part_lse_ptr + part_row, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=row_valid)
            tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :],
                     tl.zeros([BLOCK_G, HEAD_DIM], tl.float32), mask=row_valid[:, None])


def cascade_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor,
                             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                             plan: CascadePlan, new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                             parts: tuple[torch.Tensor, torch.Tensor] | None = None,
                             prefix_splits: int = PREFIX_SPLITS, suffix_splits: int | None = None,
                             config: DecodeConfig = DecodeConfig()) -> torch.Tensor:
    """out[seq's token] = attention of its one query over its cached keys (full attention), the
    groups' shared prefixes read once a group (`plan`); q/out [T, H, D], kv_cache
    [2, blocks, page, KVH, D], arguments as `decode_attention`'s. `new_kv = (k, v, slot_mapping)`:
    the step's own keys come from k/v and are written to the cache by this launch (a negative
    slot skips the write). The suffixes split as the decode kernel's launches would
    (`suffix_splits` None: `decode.plan_splits` for `max_seq_len`, and its tiles). `parts`: the
    partials' buffers ([N, H, splits, D] and [N, H, splits] float32, every slot of which the
    kernels rewrite); None allocates them."""
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    if suffix_splits is None:
        suffix_splits = plan_splits(num_seqs, num_kv_heads, max_seq_len, sm_count(q.device), config)
    num_parts = suffix_splits + prefix_splits
    part_out, part_lse = parts if parts is not None else (
        torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device),
        torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    common = dict(NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page, SUFFIX_SPLITS=suffix_splits,
                  PREFIX_SPLITS=prefix_splits, DOT_PRECISION=dot_precision(kv_cache.dtype))
    if plan.num_groups:   # the decode kernel's unsplit tiles: a prefix split is a few hundred keys
        _prefix_kernel[(plan.num_groups, num_kv_heads, prefix_splits)](
            q, k_cache, v_cache, part_out, part_lse, query_start_loc, plan.tables, plan.lens, plan.members,
            q.stride(0), q.stride(1), plan.tables.stride(0), plan.members.stride(0), *cache_strides, num_parts,
            scale * LOG2E, MEMBERS=MAX_MEMBERS, BLOCK_R=max(16, triton.next_power_of_2(MAX_MEMBERS * group)),
            BLOCK_N=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages, **common)
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, seq_lens)   # never read without new_kv
    block_n, num_warps, num_stages = config.tile(suffix_splits)
    _suffix_kernel[(num_seqs, num_kv_heads, suffix_splits)](
        q, k_cache, v_cache, part_out, part_lse, query_start_loc, block_table, seq_lens, plan.skip,
        q.stride(0), q.stride(1), block_table.stride(0), *cache_strides, num_parts, scale * LOG2E,
        k_new, v_new, slots, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, WRITE_NEW=new_kv is not None,
        num_warps=num_warps, num_stages=num_stages, **common)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, query_start_loc, out.stride(0), out.stride(1), num_parts, NUM_HEADS=num_heads,
        SPLITS_POW2=max(2, triton.next_power_of_2(num_parts)), HEAD_DIM=head_dim, SINGLE_ONLY=False)
    return out
