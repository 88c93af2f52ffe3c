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

Decode (few tokens, bounded key lists) takes the planned path: a small
kernel first resolves every key's storage row (index row -> block table ->
row), so the attention loop's only dependent load is one row number per
key and the key tiles stream through the software pipeline; computed
inline, the two dependent lookups sat between each tile and the next
(measured: ~5 us a 32-key tile at one program per SM).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.attention.kernels.common import dot_precision, optional_gluon_module
from kvserve.model.deepseek_v4.kernels.pages import PageRef, V4PagedBatch, entry_rows, sm_count, token_rows

LOG2E = 1.4426950408889634
_LOG2E_IN_KERNEL = tl.constexpr(LOG2E)
MAX_SPLITS = 32
PLAN_BLOCK = 256               # key rows resolved per plan program
PLAN_MAX_SLOTS = 1 << 22       # tokens x keys of the planned path (a 32 MB plan); longer batches: rows inline


@dataclass(frozen=True)
class SparseAttentionConfig:
    block_n: int = 32        # keys per tile
    num_warps: int = 8       # 64 heads x 512 dims of fp32 accumulator: 128 registers a thread at 8 warps
    num_stages: int = 2
    # Query heads a program holds (None: all). Fewer heads: a smaller accumulator
    # and more programs, each key row read once per head group (from L2 after the first).
    block_h: int | None = None
    # Split-KV: the split count minimises waves x (tiles per split + split_cost),
    # a wave being num_sms x programs_per_sm programs. A split costs a partial
    # write + read (heads x head_dim x 8 bytes per token), about `split_cost` tiles.
    programs_per_sm: int = 1  # the [64 x 512] fp32 accumulator takes the register file
    split_cost: float = 2.0
    num_splits: int | None = None  # fixed split count (bench sweeps); None = the cost model
    planned: bool = False          # key rows resolved by the plan kernel first (decode)
    # Planned only: key tiles loaded one tile ahead into registers by the loop
    # itself (num_stages 1) instead of by the compiler's software pipeline.
    prefetch: bool = False
    # The warp-specialized Gluon kernel (`sparse_decode_gluon.py`) on the plan where it
    # supports the launch (Hopper, 64 heads x 512, bf16); elsewhere this config's Triton kernel.
    gluon: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps", "block_h"):
            value = getattr(self, name) or 16
            if value < 1 or value & (value - 1):
                raise ValueError(f"SparseAttentionConfig.{name} must be a power of two, got {value}")
        if min(self.block_n, self.block_h or 16) < 16:
            raise ValueError(f"SparseAttentionConfig.block_n and block_h must be >= 16 (dot operands), got "
                             f"{self.block_n}, {self.block_h}")
        if self.num_stages < 1 or self.programs_per_sm < 1 or self.split_cost < 0:
            raise ValueError(f"SparseAttentionConfig needs num_stages >= 1, programs_per_sm >= 1 and "
                             f"split_cost >= 0, got {self.num_stages}, {self.programs_per_sm}, {self.split_cost}")
        if self.prefetch and not self.planned:
            raise ValueError("SparseAttentionConfig.prefetch reads the key plan: it needs planned=True")
        if self.num_splits is not None and not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"SparseAttentionConfig.num_splits must be in [1, {MAX_SPLITS}], got {self.num_splits}")


# The configs the kernel runs when the caller passes none: (tokens up to, config),
# first match wins. Edit from `benchmarks/v4_kernel_bench.py`'s "best config" table.
# From its H200 runs (V4-Flash dims, 32K and 128K contexts, batch 1/64/256): the
# inline kernel at small batches (batch 1: 49-55 us with the modelled split
# count; batch 64: 65-109 us with 1-2 splits, 270-370 us planned or with the
# modelled count), at 256 the planned one, 64 keys a tile, one split (132-158 us).
PREFILL_CONFIG = SparseAttentionConfig()
DECODE_CONFIGS = (
    (8, SparseAttentionConfig(num_stages=3)),
    (128, SparseAttentionConfig(num_splits=2)),
    (1 << 30, SparseAttentionConfig(block_n=64, num_splits=1, planned=True)),
)


# From GLUON_MIN_TOKENS tokens (unless KVSERVE_GLUON_SPARSE=0): the Gluon kernel, else the planned one.
GLUON_CONFIG = SparseAttentionConfig(block_n=64, num_splits=1, planned=True, gluon=True)


def default_config(num_tokens: int, max_keys: int) -> SparseAttentionConfig:
    """The planned decode config while its plan stays small, else the prefill one."""
    if num_tokens * max_keys > PLAN_MAX_SLOTS:
        return PREFILL_CONFIG
    gluon = _gluon_module()
    if gluon is not None and gluon.enabled_by_env() and num_tokens >= gluon.GLUON_MIN_TOKENS:
        return GLUON_CONFIG
    return next(config for bound, config in DECODE_CONFIGS if num_tokens <= bound)


def _gluon_module():
    """The Gluon kernel's module, or None where this Triton lacks Gluon's Hopper API."""
    return optional_gluon_module("kvserve.model.deepseek_v4.kernels.sparse_decode_gluon",
                                 "V4 attention runs the Triton kernels")


def head_block(config: SparseAttentionConfig, num_heads: int) -> int:
    """Query heads a program holds: the config's, else all of them (at least 16: a dot operand)."""
    return config.block_h or max(16, triton.next_power_of_2(num_heads))


def plan_splits(num_tokens: int, max_keys: int, num_sms: int, config: SparseAttentionConfig,
                head_groups: int = 1) -> int:
    """Splits per token (and head group): the count with the least modelled
    time, waves of programs x tiles each (ties: fewer splits)."""
    tiles = max(1, triton.cdiv(max_keys, config.block_n))
    limit = max(1, min(tiles, MAX_SPLITS))
    if config.num_splits is not None:
        return min(config.num_splits, limit)
    slots = num_sms * config.programs_per_sm

    def cost(splits: int) -> float:
        waves = triton.cdiv(max(num_tokens, 1) * head_groups * splits, slots)
        return waves * (triton.cdiv(tiles, splits) + (config.split_cost if splits > 1 else 0.0))
    return min(range(1, limit + 1), key=lambda s: (cost(s), s))


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


@triton.jit(do_not_specialize=["sliding_stride_table", "entry_stride_table", "topk", "window", "plan_width"])
def _key_plan_kernel(
        unit, sliding_offset, sliding_width, sliding_table, sliding_stride_table,
        entry_offset, entry_width, entry_table, entry_stride_table,
        index_ptr, stride_it, seq_idx_ptr, pos_ptr, window, topk, plan_ptr, plan_width,
        RATE: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_CSA: tl.constexpr, ROW_ALIGN: tl.constexpr,
        BLOCK: tl.constexpr):
    """plan[t, j]: key j's storage offset / ROW_ALIGN, -1 past the token's keys
    (or a CSA slot without a choice). Every slot < plan_width is written."""
    t = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seq = tl.load(seq_idx_ptr + t)
    pos = tl.load(pos_ptr + t).to(tl.int32)
    num_window, num_keys = _key_counts(seq, pos, window, topk, RATE, IS_CSA)
    row = tl.maximum(seq, 0).to(tl.int64)
    rows, valid = _key_rows(j, num_keys, num_window, pos, unit, sliding_table + row * sliding_stride_table,
                            sliding_offset, sliding_width, entry_table + row * entry_stride_table, entry_offset,
                            entry_width, index_ptr + t.to(tl.int64) * stride_it, RATE, PAGE_SIZE, IS_CSA)
    tl.store(plan_ptr + t.to(tl.int64) * plan_width + j, tl.where(valid, rows // ROW_ALIGN, -1),
             mask=j < plan_width)


@triton.jit
def _planned_rows(plan_row_ptr, j, end, ROW_ALIGN: tl.constexpr):
    """The plan's storage offsets (multiples of ROW_ALIGN: 16-byte key loads) of keys j < end."""
    unit_rows = tl.load(plan_row_ptr + j, mask=j < end, other=-1)
    valid = unit_rows >= 0
    return tl.maximum(unit_rows, 0) * ROW_ALIGN, valid


@triton.jit
def _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over the key tile k (K = V), invalid keys masked."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


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


@triton.jit(do_not_specialize=["sliding_stride_table", "entry_stride_table", "num_splits", "topk", "window",
                               "plan_width"])
def _sparse_attention_kernel(
        q_ptr, stride_qt, stride_qh, storage_ptr, unit,
        sliding_offset, sliding_width, sliding_table, sliding_stride_table,
        entry_offset, entry_width, entry_table, entry_stride_table,
        index_ptr, stride_it, sink_ptr, seq_idx_ptr, pos_ptr, qk_scale, window, topk,
        out_ptr, stride_ot, stride_oh, part_out_ptr, part_lse_ptr, num_splits, num_heads, plan_ptr, plan_width,
        RATE: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr, IS_CSA: tl.constexpr, DOT_PRECISION: tl.constexpr, PLANNED: tl.constexpr,
        PREFETCH: tl.constexpr, ROW_ALIGN: tl.constexpr):
    t = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.load(seq_idx_ptr + t)
    pos = tl.load(pos_ptr + t).to(tl.int32)
    num_window, num_keys = _key_counts(seq, pos, window, topk, RATE, IS_CSA)
    split_len = tl.cdiv(tl.cdiv(num_keys, BLOCK_N), num_splits) * BLOCK_N
    start = split * split_len
    end = tl.minimum(num_keys, start + split_len)

    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
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
    plan_row_ptr = plan_ptr + t.to(tl.int64) * plan_width
    if PREFETCH:  # planned rows two tiles ahead, key tiles one tile ahead, in registers
        rows, valid = _planned_rows(plan_row_ptr, start + tl.arange(0, BLOCK_N), end, ROW_ALIGN)
        k_next = tl.load(storage_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        rows, valid_next = _planned_rows(plan_row_ptr, start + BLOCK_N + tl.arange(0, BLOCK_N), end, ROW_ALIGN)
        for j0 in range(start, end, BLOCK_N):
            k = k_next
            k_next = tl.load(storage_ptr + rows[:, None] + dims[None, :], mask=valid_next[:, None], other=0.0)
            rows, valid_after = _planned_rows(plan_row_ptr, j0 + 2 * BLOCK_N + tl.arange(0, BLOCK_N), end,
                                              ROW_ALIGN)
            m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION)
            valid, valid_next = valid_next, valid_after
    else:
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            if PLANNED:
                rows, valid = _planned_rows(plan_row_ptr, j, end, ROW_ALIGN)
            else:
                rows, valid = _key_rows(j, end, num_window, pos, unit, sliding_row_ptr, sliding_offset,
                                        sliding_width, entry_row_ptr, entry_offset, entry_width, index_row_ptr, RATE,
                                        PAGE_SIZE, IS_CSA)
            k = tl.load(storage_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION)
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
    """A token's key bound, rounded up to a multiple of 16 (the slots past a token's keys plan -1):
    the plan's width and stride then specialise alike at every context, and the Gluon kernel builds
    once per key-tile bound, not twice."""
    entries = batch.max_seq_len // rate if rate else 0
    keys = min(window, batch.max_seq_len) + (min(entries, topk) if topk is not None else entries)
    return -(-max(1, keys) // 16) * 16


def row_align_of(batch: V4PagedBatch, sliding: PageRef, entries: PageRef | None) -> int:
    """The plan's storage-offset unit for a layer's pages (a sliding-only layer: no entry pages)."""
    # a sliding-only layer's stand-in entry pages are never read: they do not narrow the unit
    entry_terms = (entries.offset, entries.width) if entries is not None else ()
    return _row_align(batch.storage.stride(0), sliding.offset, sliding.width, *entry_terms)


def _row_align(*offsets: int) -> int:
    """The largest power of two up to 16 dividing every storage offset term."""
    return math.gcd(16, *offsets)


def _plan(sliding: PageRef, pages: PageRef, index: torch.Tensor, batch: V4PagedBatch, window: int, topk: int,
          rate: int, max_keys: int, row_align: int, is_csa: bool) -> torch.Tensor:
    """[T, max_keys] int64: every key's storage offset / row_align (-1: none)."""
    plan = torch.empty(batch.num_tokens, max_keys, dtype=torch.int64, device=batch.storage.device)
    _key_plan_kernel[(batch.num_tokens, triton.cdiv(max_keys, PLAN_BLOCK))](
        batch.storage.stride(0), sliding.offset, sliding.width, sliding.table, sliding.table.stride(0),
        pages.offset, pages.width, pages.table, pages.table.stride(0), index, index.stride(0), batch.seq_idx,
        batch.positions, window, topk, plan, max_keys, RATE=rate, PAGE_SIZE=batch.block_size, IS_CSA=is_csa,
        ROW_ALIGN=row_align, BLOCK=PLAN_BLOCK, num_warps=4)
    return plan


def _run_gluon(gluon, q: torch.Tensor, storage: torch.Tensor, plan: torch.Tensor, row_align: int,
               sinks: torch.Tensor, scale: float, out: torch.Tensor) -> bool:
    """The Gluon kernel on the plan; False (and the kernel switched off) where it fails to
    build, so this and later launches run the Triton kernel (its first launch is eager: the
    engine's warm-up, before any graph capture)."""
    try:
        gluon.sparse_decode_gluon(q, storage, plan, row_align, sinks, scale * LOG2E, out)
    except triton.compiler.errors.CompilationError as e:
        gluon.disable(f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}")
        return False
    return True


def sparse_attention(q: torch.Tensor, sliding: PageRef, entries: PageRef | None, indices: torch.Tensor | None,
                     sinks: torch.Tensor, scale: float, window: int, rate: int, batch: V4PagedBatch,
                     out: torch.Tensor, config: SparseAttentionConfig | None = None) -> torch.Tensor:
    """out [T, H, D] = attention of q [T, H, D] over each token's window keys
    (sliding pages) and compressed entries (entry pages, first D columns of a
    row): all visible ones, or with `indices` [T, >= topk] int32 (CSA) the
    chosen ones, listed first in each row with -1 after them. `rate` 0 and
    no `entries`: a sliding-only layer. sinks [H] float32. `config` None:
    `default_config`."""
    num_tokens, num_heads, head_dim = q.shape
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton V4 attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if (entries is None) != (rate == 0):
        raise ValueError(f"sparse_attention: entry pages and a compress rate come together, got rate {rate}")
    if num_tokens == 0:
        return out
    topk = indices.shape[1] if indices is not None else None
    max_keys = max(1, _max_keys(batch, window, rate, topk))
    config = config if config is not None else default_config(num_tokens, max_keys)
    block_h = head_block(config, num_heads)
    head_groups = triton.cdiv(num_heads, block_h)
    num_splits = plan_splits(num_tokens, max_keys, sm_count(q.device), config, head_groups)
    pages = entries if entries is not None else PageRef(sliding.table, 0, 1, 0)
    index = indices if indices is not None else batch.seq_idx[:, None]  # never read without indices
    row_align = row_align_of(batch, sliding, entries)
    gluon = _gluon_module() if config.gluon else None
    if gluon is not None and gluon.supports(q, batch.storage, out, max_keys, row_align):
        plan = _plan(sliding, pages, index, batch, window, topk or 0, rate, max_keys, row_align, topk is not None)
        if _run_gluon(gluon, q, batch.storage, plan, row_align, sinks, scale, out):
            return out
    part_shape = (1,) if num_splits == 1 else (num_tokens, num_heads, num_splits, head_dim)
    part_out = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(part_shape[:3], dtype=torch.float32, device=q.device)
    plan = batch.seq_idx  # never read unplanned
    if config.planned:
        plan = _plan(sliding, pages, index, batch, window, topk or 0, rate, max_keys, row_align, topk is not None)
    _sparse_attention_kernel[(num_tokens, num_splits, head_groups)](
        q, q.stride(0), q.stride(1), batch.storage, batch.storage.stride(0),
        sliding.offset, sliding.width, sliding.table, sliding.table.stride(0),
        pages.offset, pages.width, pages.table, pages.table.stride(0),
        index, index.stride(0), sinks, batch.seq_idx, batch.positions, scale * LOG2E, window, topk or 0,
        out, out.stride(0), out.stride(1), part_out, part_lse, num_splits, num_heads, plan, max_keys,
        RATE=rate, PAGE_SIZE=batch.block_size, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_N=config.block_n,
        IS_CSA=indices is not None, DOT_PRECISION=dot_precision(batch.storage.dtype), PLANNED=config.planned,
        PREFETCH=config.prefetch, ROW_ALIGN=row_align, num_warps=config.num_warps, num_stages=config.num_stages)
    if num_splits > 1:
        _reduce_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_splits, num_heads,
            SPLITS_POW2=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim)
    return out
