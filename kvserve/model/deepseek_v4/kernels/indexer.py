"""Lightning Indexer kernels: each query's scores over its visible indexer
keys, then its top-k entries, deterministic on ties.

Scores: sum over indexer heads h of w_h * ReLU(q_h . k) / sqrt(d), for the
entries whose windows end at or before the query (the first (p + 1) // rate).
One program scores one token's chunk of entries, all indexer heads in one
tl.dot (keys x heads: `ScoreConfig.key_rows`), so each key is read once per token.

Top-k: an exact radix select per token over the order-preserving uint32 keys
of the float scores (`TopKConfig.radix_bits` per pass: a histogram of that
many bits' bins; a row of one tile stays in registers across the passes)
finds the k-th largest score T; the chosen entries are those above T plus the earliest ones
equal to T, as the stable sort of `v4_torch_ref.top_k_mask` chooses. Indices are
written in ascending entry order, -1 after them; every row is fully written.

Long rows take a shortcut first (`TopKConfig.candidates`): the row's maxima
over groups of G entries bound T from below (the k largest maxima are k
distinct entries, so T >= the k-th largest maximum L). Entries >= L are few
(about k plus the runners-up inside the k best groups), so one pass compacts
them, in entry order, into a buffer of `groups_per_k` x k and the radix passes run on that
tile in registers: two passes over the row instead of one per radix digit.
A row whose candidates overflow the buffer (heavy ties) takes the full passes.
The compaction is most of the shortcut's time (a prefix sum per step of the row;
`benchmarks/top_k_probe.py`). With `TopKConfig.group_list` (TOP_K_CONFIG's) it first lists the
groups whose maximum reaches L, in order, and reads only those: no other entry
can reach L, so the candidates are the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.attention.kernels.common import dot_precision
from kvserve.model.deepseek_v4.kernels.pages import PageRef, V4PagedBatch, entry_rows, sm_count

SCORE_BUFFER_BYTES = 256 << 20  # score rows (+ the top-k's scratch) per launch pair, at most (a row: a token)
# Scores a compaction step takes per thread: 32 crash Triton 3.6's LLVM (an SLP vectorizer assertion).
COMPACT_PER_THREAD = 8


@dataclass(frozen=True)
class ScoreConfig:
    block_e: int = 64        # keys per score tile
    # The tile's dot as keys x heads (False: heads x keys). 0.82x the time on the
    # H200 at 256 x 128K; expected cause, not profiled: the sum over heads then
    # runs along the dot's N dimension, within a thread quad, not across warps.
    key_rows: bool = True
    waves: int = 4           # score programs: about this many waves over the SMs
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_e < 16 or self.block_e & (self.block_e - 1) or min(self.waves, self.num_stages) < 1:
            raise ValueError(f"ScoreConfig needs a power-of-two block_e >= 16 and waves, num_stages >= 1, got {self}")


@dataclass(frozen=True)
class TopKConfig:
    radix_bits: int = 8      # bits a radix pass resolves (BINS = 2**bits histogram bins)
    max_tile: int = 16384    # scores per tile: a row up to this long is one tile, read once into registers
    num_warps: int | None = None  # None: a warp per 1,024 scores of the tile, 4 to 16
    candidates: bool = True  # rows of >= 8k entries: bound T by group maxima, radix over the candidates
    groups_per_k: int = 4    # the shortcut's group maxima (and candidate buffer): this many times k
    # Compact from the groups whose maximum reaches the bound only (about k of groups_per_k x k),
    # not the whole row: 74 -> 41 us at 256 x 128K on an H100 (docs/BENCHMARKS.md); TOP_K_CONFIG's.
    group_list: bool = False

    def __post_init__(self) -> None:
        if self.radix_bits not in (2, 4, 8) or self.max_tile < 1024 or self.max_tile & (self.max_tile - 1) or \
                self.groups_per_k < 2:
            raise ValueError(f"TopKConfig needs radix_bits in (2, 4, 8), a power-of-two max_tile >= 1024 and "
                             f"groups_per_k >= 2, got {self}")


# The configs the kernels run when the caller passes none (edit from
# benchmarks/v4_kernel_bench.py's "best config" table).
SCORE_CONFIG = ScoreConfig()
# radix/tile/warps: the H200 bench's best at 256 x 128K; group_list: measured on an H100 and an H200 (2026-12-05)
TOP_K_CONFIG = TopKConfig(radix_bits=4, max_tile=4096, num_warps=8, group_list=True)


@triton.jit(do_not_specialize=["stride_table"])
def _index_scores_kernel(q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, storage_ptr, unit, key_offset,
                         key_width, table_ptr, stride_table, scores_ptr, stride_st, seq_idx_ptr, pos_ptr,
                         num_heads, chunk, scale, RATE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, KEY_ROWS: tl.constexpr):
    t = tl.program_id(0)
    seq = tl.load(seq_idx_ptr + t)
    pos = tl.load(pos_ptr + t).to(tl.int32)
    num_entries = tl.where(seq >= 0, (pos + 1) // RATE, 0)
    start = tl.program_id(1) * chunk
    end = tl.minimum(num_entries, start + chunk)
    if start >= end:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    head_mask = heads < num_heads
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None], other=0.0).to(storage_ptr.dtype.element_ty)
    weights = tl.load(w_ptr + t.to(tl.int64) * stride_wt + heads, mask=head_mask, other=0.0)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    score_row = scores_ptr + t.to(tl.int64) * stride_st
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        valid = e < end
        rows = entry_rows(table_row, e, valid, unit, key_offset, key_width, RATE, PAGE_SIZE)
        k = tl.load(storage_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if KEY_ROWS:
            s = tl.maximum(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), 0.0) * scale
            score = tl.sum(s * weights[None, :], 1)
        else:
            s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), 0.0) * scale
            score = tl.sum(s * weights[:, None], 0)
        tl.store(score_row + e, score, mask=valid)


@triton.jit
def _sortable(scores):
    """uint32 keys ordered as the float scores (-0.0 and 0.0 are one key: they tie in torch)."""
    scores = tl.where(scores == 0.0, 0.0, scores)
    bits = scores.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def _pick_digit(hist, want, BINS: tl.constexpr):
    """The digit holding the want-th largest key, how many keys of the
    current prefix lie above that digit, and how many hold it."""
    bins = tl.arange(0, BINS)
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    digit = tl.max(tl.where(at_or_above >= want, bins, -1), 0)
    above = tl.sum(tl.where(bins > digit, hist, 0), 0)
    return digit, above, tl.sum(tl.where(bins == digit, hist, 0), 0)


@triton.jit
def _row_keys(score_row, e0, num_entries, BLOCK: tl.constexpr):
    """(sortable keys, validity) of the scores e0 .. e0 + BLOCK of a row."""
    e = e0 + tl.arange(0, BLOCK)
    valid = e < num_entries
    return _sortable(tl.load(score_row + e, mask=valid, other=0.0)), valid


@triton.jit
def _radix_step(hist, want, prefix, high, shift, BITS: tl.constexpr):
    """Fix the digit at `shift` from its histogram: (want, prefix, high, done)."""
    digit, above, in_bin = _pick_digit(hist, want, 1 << BITS)
    want -= above
    prefix |= digit.to(tl.uint32) << shift
    high |= tl.full([], (1 << BITS) - 1, tl.uint32) << shift
    return want, prefix, high, want == in_bin


@triton.jit
def _radix_tile(key, valid, k, BITS: tl.constexpr):
    """(T, high, n) as _radix_threshold, over one tile of keys held in registers."""
    BINS: tl.constexpr = 1 << BITS
    prefix = tl.zeros([], tl.uint32)
    high = tl.zeros([], tl.uint32)
    want = k
    done = k <= 0
    for shift in tl.static_range(32 - BITS, -BITS, -BITS):
        if not done:
            match = valid & ((key & high) == prefix)
            hist = tl.histogram(((key >> shift) & (BINS - 1)).to(tl.int32), BINS, mask=match)
            want, prefix, high, done = _radix_step(hist, want, prefix, high, shift, BITS)
    return prefix, high, want


@triton.jit
def _radix_threshold(score_row, num_entries, k, BLOCK: tl.constexpr, BITS: tl.constexpr,
                     ONE_TILE: tl.constexpr):
    """(T, high, n): the top k are the keys whose bits under `high` exceed T,
    then the first n whose bits under `high` equal T. Passes of BITS bits stop
    once the bin holding the k-th key is taken whole (with distinct scores,
    usually before the last digit). ONE_TILE: the row fits one tile, loaded once."""
    if ONE_TILE:
        key, valid = _row_keys(score_row, 0, num_entries, BLOCK)
        return _radix_tile(key, valid, k, BITS)
    BINS: tl.constexpr = 1 << BITS
    prefix = tl.zeros([], tl.uint32)
    high = tl.zeros([], tl.uint32)
    want = k
    done = k <= 0
    for shift in tl.static_range(32 - BITS, -BITS, -BITS):
        if not done:
            hist = tl.zeros([BINS], tl.int32)
            for e0 in range(0, num_entries, BLOCK):
                tile, in_row = _row_keys(score_row, e0, num_entries, BLOCK)
                match = in_row & ((tile & high) == prefix)
                hist += tl.histogram(((tile >> shift) & (BINS - 1)).to(tl.int32), BINS, mask=match)
            want, prefix, high, done = _radix_step(hist, want, prefix, high, shift, BITS)
    return prefix, high, want


@triton.jit
def _choose(key, valid, threshold, high, num_equal, equal_before):
    """Of one tile: the keys above the threshold and the first `num_equal -
    equal_before` equal to it; (chosen, how many equal to it)."""
    key &= high
    equal = (valid & (key == threshold)).to(tl.int32)
    equal_rank = equal_before + tl.cumsum(equal, 0) - 1
    chosen = (valid & (key > threshold)) | ((equal == 1) & (equal_rank < num_equal))
    return chosen, tl.sum(equal, 0)


@triton.jit
def _store_chosen(out_row, taken, entries, chosen):
    """Append the chosen entries of a tile at out_row[taken:]; the new count."""
    slot = taken + tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(out_row + slot, entries, mask=chosen)
    return taken + tl.sum(chosen.to(tl.int32), 0)


@triton.jit
def _group_bound(score_row, max_row, num_entries, num_groups, k, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_G: tl.constexpr, BITS: tl.constexpr):
    """A key <= the row's k-th largest: the top digits of the k-th largest of
    the maxima over groups of GROUP entries (written to max_row, read back)."""
    for e0 in range(0, num_entries, BLOCK):  # maxima of the scores (float: order as their keys)
        e = e0 + tl.arange(0, BLOCK)
        score = tl.load(score_row + e, mask=e < num_entries, other=float("-inf"))
        group_max = _sortable(tl.max(tl.reshape(score, [BLOCK // GROUP, GROUP]), 1))
        g = e0 // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(max_row + g, group_max.to(tl.int32, bitcast=True), mask=g < num_groups)
    tl.debug_barrier()  # the maxima are read back by other threads of the program
    g = tl.arange(0, BLOCK_G)
    maxima = tl.load(max_row + g, mask=g < num_groups, other=0).to(tl.uint32, bitcast=True)
    bound, _, _ = _radix_tile(maxima, g < num_groups, k, BITS)
    return bound


@triton.jit
def _append_candidates(key, valid, entries, bound, count, cand_key_row, cand_idx_row, CAND: tl.constexpr):
    """Append the keys >= bound of one step (and their entries) at slot `count` on, in order,
    stopping at CAND stored; returns the new count (more than CAND: not all stored)."""
    is_cand = valid & (key >= bound)
    slot = count + tl.cumsum(is_cand.to(tl.int32), 0) - 1
    keep = is_cand & (slot < CAND)
    tl.store(cand_key_row + slot, key.to(tl.int32, bitcast=True), mask=keep)
    tl.store(cand_idx_row + slot, entries.to(tl.int32), mask=keep)
    return count + tl.sum(is_cand.to(tl.int32), 0)


@triton.jit
def _compact_candidates(score_row, cand_key_row, cand_idx_row, num_entries, bound, BLOCK: tl.constexpr,
                        CAND: tl.constexpr):
    """Store the entries whose keys are >= bound, in entry order (at most CAND
    of them); returns how many there are (more than CAND: not all stored)."""
    count = tl.zeros([], tl.int32)
    for e0 in range(0, num_entries, BLOCK):
        key, valid = _row_keys(score_row, e0, num_entries, BLOCK)
        count = _append_candidates(key, valid, e0 + tl.arange(0, BLOCK), bound, count, cand_key_row, cand_idx_row,
                                   CAND)
    return count


@triton.jit
def _bound_groups(max_row, num_groups, bound, BLOCK_G: tl.constexpr):
    """The groups whose maximum is >= bound, the only ones holding candidates: their ids, in
    order, written over the maxima at max_row; returns how many."""
    g = tl.arange(0, BLOCK_G)
    maxima = tl.load(max_row + g, mask=g < num_groups, other=0).to(tl.uint32, bitcast=True)
    hit = (g < num_groups) & (maxima >= bound)
    slot = tl.cumsum(hit.to(tl.int32), 0) - 1
    tl.debug_barrier()  # every thread has read its maxima before ids overwrite them
    tl.store(max_row + slot, g, mask=hit)
    tl.debug_barrier()  # the ids are read back by other threads
    return tl.sum(hit.to(tl.int32), 0)


@triton.jit
def _compact_groups(score_row, group_row, num_hit, cand_key_row, cand_idx_row, num_entries, bound,
                    GROUP: tl.constexpr, STEP_GROUPS: tl.constexpr, CAND: tl.constexpr):
    """`_compact_candidates` over the `num_hit` groups listed at group_row (`_bound_groups`) only:
    about k groups of the row's groups_per_k x k, so a quarter of the steps."""
    count = tl.zeros([], tl.int32)
    for s0 in range(0, num_hit, STEP_GROUPS):
        s = s0 + tl.arange(0, STEP_GROUPS)
        group = tl.load(group_row + s, mask=s < num_hit, other=-1)   # -1: e < 0, not valid
        e = tl.reshape(group[:, None] * GROUP + tl.arange(0, GROUP)[None, :], [STEP_GROUPS * GROUP])
        valid = (e >= 0) & (e < num_entries)
        key = _sortable(tl.load(score_row + e, mask=valid, other=0.0))
        count = _append_candidates(key, valid, e, bound, count, cand_key_row, cand_idx_row, CAND)
    return count


@triton.jit
def _candidates(score_row, scratch_row, num_entries, num_groups, bound, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                CAND: tl.constexpr, COMPACT: tl.constexpr, GROUP_LIST: tl.constexpr):
    """The shortcut's candidates, stored after the group maxima in scratch_row; how many."""
    if GROUP_LIST:  # a step of the compaction: COMPACT entries, at least one group
        STEP_GROUPS: tl.constexpr = (COMPACT + GROUP - 1) // GROUP
        num_hit = _bound_groups(scratch_row, num_groups, bound, BLOCK_G)
        count = _compact_groups(score_row, scratch_row, num_hit, scratch_row + BLOCK_G, scratch_row + BLOCK_G + CAND,
                                num_entries, bound, GROUP, STEP_GROUPS, CAND)
    else:
        count = _compact_candidates(score_row, scratch_row + BLOCK_G, scratch_row + BLOCK_G + CAND, num_entries,
                                    bound, COMPACT, CAND)
    return count


@triton.jit
def _top_k_of_candidates(cand_key_row, cand_idx_row, out_row, count, k, BITS: tl.constexpr, CAND: tl.constexpr):
    """The row's top k from its `count` (<= CAND) compacted candidates."""
    tl.debug_barrier()  # the candidates were stored by other threads of the program
    j = tl.arange(0, CAND)
    valid = j < count
    key = tl.load(cand_key_row + j, mask=valid, other=0).to(tl.uint32, bitcast=True)
    entries = tl.load(cand_idx_row + j, mask=valid, other=0)
    threshold, high, num_equal = _radix_tile(key, valid, k, BITS)
    chosen, _ = _choose(key, valid, threshold, high, num_equal, 0)
    _store_chosen(out_row, 0, entries, chosen)


@triton.jit
def _top_k_full(score_row, out_row, num_entries, k, BLOCK: tl.constexpr, BITS: tl.constexpr,
                ONE_TILE: tl.constexpr):
    """The row's top k by radix passes over the whole row."""
    threshold, high, num_equal = _radix_threshold(score_row, num_entries, k, BLOCK, BITS, ONE_TILE)
    taken = tl.zeros([], tl.int32)
    equal_before = tl.zeros([], tl.int32)
    for e0 in range(0, num_entries, BLOCK):
        key, valid = _row_keys(score_row, e0, num_entries, BLOCK)
        chosen, num_eq = _choose(key, valid, threshold, high, num_equal, equal_before)
        taken = _store_chosen(out_row, taken, (e0 + tl.arange(0, BLOCK)).to(tl.int32), chosen)
        equal_before += num_eq


@triton.jit
def _top_k_kernel(scores_ptr, stride_st, out_ptr, stride_ot, seq_idx_ptr, pos_ptr, k, scratch_ptr, stride_scratch,
                  RATE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr,
                  ONE_TILE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, CAND: tl.constexpr,
                  COMPACT: tl.constexpr, GROUP_LIST: tl.constexpr):
    t = tl.program_id(0)
    seq = tl.load(seq_idx_ptr + t)
    pos = tl.load(pos_ptr + t).to(tl.int32)
    num_entries = tl.where(seq >= 0, (pos + 1) // RATE, 0)
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    if num_entries <= k:  # every visible entry is chosen
        for j0 in range(0, k, BLOCK_K):
            j = j0 + tl.arange(0, BLOCK_K)
            tl.store(out_row + j, tl.where(j < num_entries, j, -1).to(tl.int32), mask=j < k)
        return
    score_row = scores_ptr + t.to(tl.int64) * stride_st
    full = num_entries > k  # (true here) cleared once the candidate shortcut has written the row
    if GROUP > 0:  # scratch row: BLOCK_G group maxima, then CAND candidate keys and CAND entries
        num_groups = (num_entries + GROUP - 1) // GROUP
        if num_groups >= k:
            scratch_row = scratch_ptr + t.to(tl.int64) * stride_scratch
            bound = _group_bound(score_row, scratch_row, num_entries, num_groups, k, BLOCK, GROUP, BLOCK_G, BITS)
            count = _candidates(score_row, scratch_row, num_entries, num_groups, bound, GROUP, BLOCK_G, CAND,
                                COMPACT, GROUP_LIST)
            full = count > CAND
            if count <= CAND:
                _top_k_of_candidates(scratch_row + BLOCK_G, scratch_row + BLOCK_G + CAND, out_row, count, k,
                                     BITS, CAND)
    if full:
        _top_k_full(score_row, out_row, num_entries, k, BLOCK, BITS, ONE_TILE)


def _score_chunk(num_tokens: int, max_entries: int, device: torch.device, config: ScoreConfig) -> int:
    """Entries per score program: enough programs for `config.waves` waves."""
    wanted = max(1, config.waves * sm_count(device) // max(num_tokens, 1))
    tiles = triton.cdiv(triton.cdiv(max_entries, wanted), config.block_e)
    return max(1, tiles) * config.block_e


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: PageRef, key_col: int, batch: V4PagedBatch,
                 rate: int, scores: torch.Tensor, config: ScoreConfig | None = None) -> torch.Tensor:
    """scores[t, e] for e < (p_t + 1) // rate (the rest of each row is not written).

    q [T, H, d] (rope applied), weights [T, H] float32 (the head weights with
    the 1/sqrt(H) factor), keys: the entry pages, whose indexer keys start at
    column `key_col`; scores [T, >= max_seq_len // rate] float32."""
    num_tokens, num_heads, head_dim = q.shape
    max_entries = batch.max_seq_len // rate
    if scores.shape[0] < num_tokens or scores.shape[1] < max_entries:
        raise ValueError(f"index score buffer {tuple(scores.shape)} is smaller than ({num_tokens}, {max_entries})")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton indexer needs a power-of-two index_head_dim >= 16, got {head_dim}")
    if num_tokens == 0 or max_entries == 0:
        return scores
    config = config if config is not None else SCORE_CONFIG
    chunk = _score_chunk(num_tokens, max_entries, q.device, config)
    grid = (num_tokens, triton.cdiv(max_entries, chunk))
    _index_scores_kernel[grid](
        q, q.stride(0), q.stride(1), weights, weights.stride(0), batch.storage, batch.storage.stride(0),
        keys.offset + key_col, keys.width, keys.table, keys.table.stride(0), scores, scores.stride(0),
        batch.seq_idx, batch.positions, num_heads, chunk, head_dim ** -0.5, RATE=rate, PAGE_SIZE=batch.block_size,
        HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_E=config.block_e,
        DOT_PRECISION=dot_precision(batch.storage.dtype), KEY_ROWS=config.key_rows, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return scores


def _candidate_group(max_entries: int, k: int, block: int, groups_per_k: int) -> int:
    """Entries per group of the candidate shortcut: about groups_per_k x k
    groups in the longest row (0: rows too short for it to pay)."""
    group = 1 << max(0, (max_entries // (groups_per_k * k)).bit_length() - 1)
    return min(group, block) if group >= 2 else 0


def _tile(max_entries: int, config: TopKConfig) -> int:
    """Scores a top-k tile holds: the whole row, up to max_tile."""
    return min(config.max_tile, max(1024, triton.next_power_of_2(max_entries)))


def _tile_and_warps(max_entries: int, config: TopKConfig) -> tuple[int, int]:
    """A launch's tile and warps (unless the config sets them: a warp per 1,024 scores, 4 to 16)."""
    block = _tile(max_entries, config)
    return block, config.num_warps or max(4, min(16, block // 1024))


def _compact_step(block: int, num_warps: int, per_thread: int = COMPACT_PER_THREAD) -> int:
    """Scores a compaction step of the shortcut takes: `per_thread` a thread, at most a tile."""
    return min(block, 32 * per_thread * num_warps)


def _shortcut_plan(max_entries: int, k: int, config: TopKConfig) -> tuple[int, int, int]:
    """The top-k shortcut's group size, group maxima and candidates per row (all 0: not taken)."""
    group = _candidate_group(max_entries, k, _tile(max_entries, config), config.groups_per_k) \
        if config.candidates else 0
    if not group:
        return 0, 0, 0
    groups = triton.next_power_of_2(triton.cdiv(max_entries, group))
    return group, groups, triton.next_power_of_2(config.groups_per_k * k)


@dataclass(frozen=True)
class TopKBuild:
    """The top-k kernel's compile-time choices for rows of up to `max_entries` scores: a launch
    with other choices compiles another build (`kernels/warmup.py` builds them at start-up)."""
    block: int
    num_warps: int
    group: int
    block_g: int
    cand: int
    one_tile: bool

    @staticmethod
    def of(max_entries: int, k: int, config: TopKConfig) -> "TopKBuild":
        block, num_warps = _tile_and_warps(max_entries, config)
        group, block_g, cand = _shortcut_plan(max_entries, k, config)
        return TopKBuild(block, num_warps, group, max(block_g, 1), max(cand, 1), block >= max_entries)


def top_k_indices(scores: torch.Tensor, batch: V4PagedBatch, rate: int, k: int, out: torch.Tensor,
                  config: TopKConfig | None = None) -> torch.Tensor:
    """out[t, :k]: token t's k best visible entries in ascending order, then -1."""
    if out.shape[0] < batch.num_tokens or out.shape[1] < k or out.dtype != torch.int32:
        raise ValueError(f"top-k index buffer must be int32 with >= ({batch.num_tokens}, {k}) entries, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if batch.num_tokens == 0:
        return out
    config = config if config is not None else TOP_K_CONFIG
    b = TopKBuild.of(max(1, batch.max_seq_len // rate), k, config)
    scratch = torch.empty(batch.num_tokens if b.group else 1, b.block_g + 2 * b.cand, dtype=torch.int32,
                          device=scores.device)
    _top_k_kernel[(batch.num_tokens,)](
        scores, scores.stride(0), out, out.stride(0), batch.seq_idx, batch.positions, k, scratch, scratch.stride(0),
        RATE=rate, BLOCK=b.block, BLOCK_K=min(1024, triton.next_power_of_2(k)), BITS=config.radix_bits,
        ONE_TILE=b.one_tile, GROUP=b.group, BLOCK_G=b.block_g, CAND=b.cand,
        COMPACT=_compact_step(b.block, b.num_warps), GROUP_LIST=config.group_list, num_warps=b.num_warps)
    return out


def score_width(max_seq_len: int, rate: int) -> int:
    """Scores a row of the buffer holds: the visible entries' bound, rounded up to a multiple of 16 (the
    kernels then see a stride Triton specialises alike at every context: no second build for that)."""
    return triton.cdiv(max(1, max_seq_len // rate), 16) * 16


def index_top_k(q: torch.Tensor, weights: torch.Tensor, keys: PageRef, key_col: int, batch: V4PagedBatch,
                rate: int, k: int) -> torch.Tensor:
    """[T, k] int32: each token's top-k visible entries (ascending, -1 padded).

    Scores are a [tokens, max_seq_len // rate] float32 buffer: long prefill
    chunks at long contexts are scored SCORE_BUFFER_BYTES at a time (an
    8,192-token chunk at 1M tokens would need 8.6 GB at once), the top-k
    shortcut's scratch counted in, in parts of a multiple of 16 rows; rows
    `score_width` wide."""
    width = score_width(batch.max_seq_len, rate)
    _, groups, candidates = _shortcut_plan(width, k, TOP_K_CONFIG)
    # Parts of a multiple of 16 rows: each part's row pointers (q, weights, positions, out) then start
    # 16-byte aligned, as Triton specialises them; an odd part would build every kernel again.
    fit = SCORE_BUFFER_BYTES // (4 * (width + groups + 2 * candidates)) // 16 * 16
    rows = min(batch.num_tokens, max(16, fit))
    scores = torch.empty(rows, width, dtype=torch.float32, device=q.device)
    out = torch.empty(batch.num_tokens, k, dtype=torch.int32, device=q.device)
    for first in range(0, batch.num_tokens, rows):
        part = batch.tokens(first, min(batch.num_tokens, first + rows))
        index_scores(q[first:first + rows], weights[first:first + rows], keys, key_col, part, rate, scores)
        top_k_indices(scores, part, rate, k, out[first:first + rows])
    return out
