"""Warp-specialized (FlashAttention-3-style) varlen prefill attention for Hopper, in Gluon.

The TMA path's job (`prefill_tma.py`: a large eager step's prompt rows over their cached
prefix and their own chunk), done the way FA3 does it. Triton 3.6 builds no warp
specialization on sm_90 (`benchmarks/prefill_ws_probe.py`), so the split is written out in
Gluon (`triton.experimental.gluon`, written against Triton 3.6.0). A program owns BLOCK_Q
query tokens of one sequence x the GQA group of one KV head (128 rows, token-major); its warps:
- a producer (one warp) streams K and V tiles of BLOCK_N keys into STAGES-deep shared-memory
  rings by TMA: first the cached prefix's pages through the block table (one copy a page,
  `BLOCK_N // page` copies a tile; a tile's pages past the prefix repeat its last page, whose
  keys the consumers mask), then the chunk's own keys from the step's K/V. It waits on each
  slot's `empty` barrier and arms its `ready` barrier with the tile's bytes;
- two consumers (one warpgroup each) own 64 rows apiece: S = Q K^T by async wgmma, the
  online softmax in exp2, O += P V (P from registers). S(j) is issued before P(j-1) V(j-1),
  so the softmax of one tile runs while the last tile's PV is in flight (FA3's overlap).
  Each consumer arrives once on a slot's `empty` barrier when done with it.
H200, Qwen3-8B heads (32 / 8, head_dim 128): 0.80-0.84x the Triton TMA kernel's time on fresh
prompts (1 x 8,192 968 against 1,171 us), 0.65-0.75x after cached prefixes, and 0.65-0.86x
the paged kernel's large tiles at every step timed (`benchmarks/tma_kernel_ab.py`, 2026-12-04).

The prefix's last tile is masked to the prefix; the chunk's last tile (the diagonal) is
masked causally. Rows with a query shorter than `min_q_len` are left to other kernels. A
masked key still enters P V with probability zero, so its value must be finite: the prefix's
last page also holds the chunk's first tokens (written to the cache before this runs), and a
chunk of at least a page fills the slots past the prefix in it. Chunks shorter than a page
after a prefix would leave slots of an earlier owner there, so the caller keeps them out
(`min_q_len`; `mixed.short_chunk_bound`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

LOG2E = 1.4426950408889634
ROWS = gl.constexpr(64)      # a consumer warpgroup's rows: the wgmma's M
HEAD_DIM = 128
# constexpr, so the jitted code may read them; a consumer is one warpgroup
CONSUMER_WARPS, PRODUCER_WARPS = gl.constexpr(4), gl.constexpr(1)
# setmaxnreg budgets (multiples of 8): the producer only issues TMA, the consumers hold S and O
CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)


@dataclass(frozen=True)
class GluonPrefillConfig:
    # Fastest on an H200 of 128- and 64-key slots, 2 to 4 deep (benchmarks/gluon_prefill_probe.py);
    # a slot must hold whole pages and a query tile's diagonal.
    block_n: int = 128
    stages: int = 2


def supports_gluon(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The shapes this kernel is built for, on top of `supports_tma`: Hopper (wgmma), head_dim
    128, a GQA group of 2 to 8 (two warpgroups of 64 rows hold whole tokens), bf16, and pages
    that divide a key tile."""
    group = q.shape[1] // kv_cache.shape[3]
    page = kv_cache.shape[2]
    return (q.is_cuda and _is_hopper(q.device.index) and q.shape[-1] == HEAD_DIM
            and group in (2, 4, 8) and q.dtype == kv_cache.dtype == torch.bfloat16
            and GluonPrefillConfig.block_n % page == 0 and page >= 8)


@functools.cache
def _is_hopper(index: int | None) -> bool:
    """Asked by every layer of a large step, up to three times (gates, short-chunk bound, launch)."""
    return torch.cuda.get_device_capability(index)[0] == 9


@gluon.jit
def _rows(tok0, GROUP: gl.constexpr, layout: gl.constexpr):
    """Token (program-relative) and head-in-group of each of a consumer's rows."""
    rows = gl.arange(0, ROWS, layout=layout)
    return tok0 + rows // GROUP, rows % GROUP


@gluon.jit
def _load_q(q_ptr, q_buf, q_start, q_len, tok0, kv_head, stride_qt, stride_qh,
            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr):
    """This warpgroup's Q rows into shared memory; rows past the sequence are zeros."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [CONSUMER_WARPS, 1], [1, 0])
    tok, head = _rows(tok0, GROUP, gl.SliceLayout(1, layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offs = (q_start + tok).to(gl.int64) * stride_qt + (kv_head * GROUP + head) * stride_qh
    q = gl.load(q_ptr + offs[:, None] + dims[None, :], mask=(tok < q_len)[:, None], other=0.0)
    q_buf.store(q.to(gl.bfloat16))
    fence_async_shared()   # the wgmma reads Q through the async proxy
    gl.thread_barrier()


@gluon.jit
def _store_out(out_ptr, acc, l_i, q_start, q_len, tok0, kv_head, stride_ot, stride_oh,
               GROUP: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Normalise and store the rows of this warpgroup that belong to the sequence."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [CONSUMER_WARPS, 1], [1, 0])
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, acc.type.layout))
    out = gl.convert_layout((acc / l_o[:, None]).to(out_ptr.dtype.element_ty), layout)
    tok, head = _rows(tok0, GROUP, gl.SliceLayout(1, layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offs = (q_start + tok).to(gl.int64) * stride_ot + (kv_head * GROUP + head) * stride_oh
    gl.store(out_ptr + offs[:, None] + dims[None, :], out, mask=(tok < q_len)[:, None])


@gluon.jit
def _softmax_step(s, m_i, l_i, limit, qk_scale, MASK: gl.constexpr):
    """Online softmax of one score tile: new max, the old state's rescale, P. With MASK,
    key c of the tile counts only where c < limit[row] (limit: keys the row may see in it)."""
    s = s * qk_scale
    if MASK:
        keys = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(keys[None, :] < limit[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _tile_limit(j, n_pre, prefix, tok, BLOCK_N: gl.constexpr):
    """Keys of tile j each row may see: up to the prefix's end in a prefix tile, up to the
    diagonal in a chunk tile (`tok` is chunk-relative)."""
    return gl.where(j < n_pre, gl.zeros_like(tok) + (prefix - j * BLOCK_N), tok + 1 - (j - n_pre) * BLOCK_N)


@gluon.jit
def _masked_softmax(s, m_i, l_i, j, n_pre, n_tiles, prefix, tok, qk_scale, BLOCK_N: gl.constexpr):
    """The softmax of tile j, masked only where a tile can hold keys a row must not see:
    the prefix's last tile and the chunk's last (its diagonal)."""
    if (j == n_pre - 1) | (j == n_tiles - 1):
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, _tile_limit(j, n_pre, prefix, tok, BLOCK_N), qk_scale, True)
    else:
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, tok, qk_scale, False)
    return p, alpha, m_i, l_i


@gluon.jit
def _qk(q_buf, k_smem, k_ready, s_zero, j, STAGES: gl.constexpr):
    """Issue S = Q K(j)^T asynchronously once K's slot is ready (K^T: a view of the slot)."""
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    k_t = k_smem.index(slot).reshape([s_zero.shape[1], q_buf.shape[1]]).permute((1, 0))
    return warpgroup_mma(q_buf, k_t, s_zero, use_acc=False, is_async=True)


@gluon.jit
def _pv(p, alpha, acc, v_smem, v_ready, j, STAGES: gl.constexpr):
    """Rescale O and issue O += P V(j) asynchronously once V's slot is ready. Returns the P
    operand too: its registers must stay untouched until the wait that names it."""
    slot = j % STAGES
    o_layout: gl.constexpr = acc.type.layout
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p16 = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
    v = v_smem.index(slot).reshape([p.shape[1], acc.shape[1]])
    return warpgroup_mma(p16, v, acc, is_async=True), p16


@gluon.jit
def _consume(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, acc, s_zero, tok, n_pre, n_tiles,
             prefix, qk_scale, STAGES: gl.constexpr):
    """Every tile, S(j) issued before P(j-1) V(j-1); returns (O, row sums)."""
    BLOCK_N: gl.constexpr = s_zero.shape[1]
    m_i = gl.full([s_zero.shape[0]], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_zero.type.layout))
    l_i = gl.zeros_like(m_i)
    s = warpgroup_mma_wait(0, deps=(_qk(q_buf, k_smem, k_ready, s_zero, 0, STAGES), ))
    mbarrier.arrive(k_empty.index(0))
    p, alpha, m_i, l_i = _masked_softmax(s, m_i, l_i, 0, n_pre, n_tiles, prefix, tok, qk_scale, BLOCK_N)
    for j in range(1, n_tiles):
        s = _qk(q_buf, k_smem, k_ready, s_zero, j, STAGES)
        acc, p16 = _pv(p, alpha, acc, v_smem, v_ready, j - 1, STAGES)
        # wgmma groups retire in order: one outstanding means S(j) is done, PV(j-1) may still run
        s = warpgroup_mma_wait(1, deps=(s, ))
        mbarrier.arrive(k_empty.index(j % STAGES))
        p, alpha, m_i, l_i = _masked_softmax(s, m_i, l_i, j, n_pre, n_tiles, prefix, tok, qk_scale, BLOCK_N)
        acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
        mbarrier.arrive(v_empty.index((j - 1) % STAGES))
    acc, p16 = _pv(p, alpha, acc, v_smem, v_ready, n_tiles - 1, STAGES)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    mbarrier.arrive(v_empty.index((n_tiles - 1) % STAGES))
    return acc, l_i


@gluon.jit
def _consumer(wg: gl.constexpr, q_ptr, out_ptr, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
              q_start, q_len, first, kv_head, n_pre, n_tiles, prefix, qk_scale,
              stride_qt, stride_qh, stride_ot, stride_oh,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: rows [wg * ROWS, (wg + 1) * ROWS) of the program's tile."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    tok0 = first + wg * (ROWS // GROUP)
    q_buf = q_smem.index(wg)
    _load_q(q_ptr, q_buf, q_start, q_len, tok0, kv_head, stride_qt, stride_qh, GROUP, HEAD_DIM)
    tok, _ = _rows(tok0, GROUP, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)   # S's accumulator operand, ignored
    acc, l_i = _consume(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, acc, s_zero, tok, n_pre,
                        n_tiles, prefix, qk_scale, STAGES)
    _store_out(out_ptr, acc, l_i, q_start, q_len, tok0, kv_head, stride_ot, stride_oh, GROUP, HEAD_DIM)


@gluon.jit
def _wait_slot(empty, ready, slot, phase, nbytes):
    mbarrier.wait(empty.index(slot), phase)
    mbarrier.expect(ready.index(slot), nbytes)


@gluon.jit
def _load_pages(desc, smem, ready, slot, table_row, j, n_pages, kv_head, PAGE: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """Prefix tile j's pages into a ring slot, one copy a page (pages past the prefix: its last)."""
    for p in gl.static_range(BLOCK_N // PAGE):
        page = gl.minimum(j * (BLOCK_N // PAGE) + p, n_pages - 1)
        block = gl.load(table_row + page)
        tma.async_copy_global_to_shared(desc, [block * PAGE, kv_head, 0], ready.index(slot),
                                        smem.index(slot).slice(p * PAGE, PAGE))


@gluon.jit
def _producer(k_desc, v_desc, kc_desc, vc_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
              table_row, q_start, kv_head, n_pre, n_tiles, prefix,
              PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: K(j) then V(j) into ring slot j % STAGES once both consumers freed it.
    A fresh barrier counts as having finished the phase before 0: the first lap passes."""
    nbytes: gl.constexpr = k_desc.block_type.nbytes
    n_pages = gl.cdiv(prefix, PAGE)
    for j in range(n_pre):
        slot = j % STAGES
        phase = ((j // STAGES) & 1) ^ 1
        _wait_slot(k_empty, k_ready, slot, phase, nbytes)
        _load_pages(kc_desc, k_smem, k_ready, slot, table_row, j, n_pages, kv_head, PAGE, BLOCK_N)
        _wait_slot(v_empty, v_ready, slot, phase, nbytes)
        _load_pages(vc_desc, v_smem, v_ready, slot, table_row, j, n_pages, kv_head, PAGE, BLOCK_N)
    for j in range(n_pre, n_tiles):   # rows past T come back zero; the next sequence's are masked
        slot = j % STAGES
        phase = ((j // STAGES) & 1) ^ 1
        row = q_start + (j - n_pre) * BLOCK_N
        _wait_slot(k_empty, k_ready, slot, phase, nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_head, 0], k_ready.index(slot), k_smem.index(slot))
        _wait_slot(v_empty, v_ready, slot, phase, nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_head, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, count: gl.constexpr):
    """STAGES mbarriers, each completing a phase on `count` arrivals (the other Gluon kernels' too)."""
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def _program_tile(tiles_ptr, NUM_KV_HEADS: gl.constexpr, BLOCK_Q: gl.constexpr, LISTED: gl.constexpr):
    """(sequence, first query token, KV head) of this program. LISTED: one program per (work
    item of `plan_tiles`, KV head), the item's heads side by side; else the full grid (query
    tile counted down: a row's last tiles start first, KV head, sequence), whose programs past
    a row's query exit at once."""
    if LISTED:
        item = gl.program_id(0) // NUM_KV_HEADS
        return gl.load(tiles_ptr + 2 * item), gl.load(tiles_ptr + 2 * item + 1), gl.program_id(0) % NUM_KV_HEADS
    else:
        first = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_Q
        return gl.program_id(2), first, gl.program_id(1)


@gluon.jit(do_not_specialize=["stride_table", "min_q_len"])
def _prefill_gluon_kernel(q_ptr, k_desc, v_desc, kc_desc, vc_desc, out_ptr, block_table_ptr,
                          query_start_loc_ptr, seq_lens_ptr, tiles_ptr, qk_scale, min_q_len,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                          GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_PREFIX: gl.constexpr,
                          LISTED: gl.constexpr, NUM_KV_HEADS: gl.constexpr):
    """Program: a query tile of one sequence x one KV head (`_program_tile`)."""
    BLOCK_Q: gl.constexpr = 2 * ROWS // GROUP
    gl.static_assert(BLOCK_N % BLOCK_Q == 0, "the diagonal must fall in a query tile's last key tile")
    seq, first, kv_head = _program_tile(tiles_ptr, NUM_KV_HEADS, BLOCK_Q, LISTED)
    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    if (first < q_len) & (q_len >= min_q_len):
        prefix = q_len * 0
        if HAS_PREFIX:
            prefix = gl.load(seq_lens_ptr + seq) - q_len
        n_pre = gl.cdiv(prefix, BLOCK_N)
        # chunk keys [0, min(first + BLOCK_Q, q_len)); BLOCK_Q <= BLOCK_N puts the diagonal in the last tile
        n_tiles = n_pre + gl.cdiv(gl.minimum(first + BLOCK_Q, q_len), BLOCK_N)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        k_ready, v_ready = ring_barriers(STAGES, 1), ring_barriers(STAGES, 1)
        k_empty, v_empty = ring_barriers(STAGES, 2), ring_barriers(STAGES, 2)   # one arrival per consumer
        table_row = block_table_ptr + seq.to(gl.int64) * stride_table
        # arguments spelled out in place: a tuple bound to a name would turn the constexprs into tensors
        gl.warp_specialize([
            (_consumer, (0, q_ptr, out_ptr, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_start,
                         q_len, first, kv_head, n_pre, n_tiles, prefix, qk_scale, stride_qt, stride_qh,
                         stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_N, STAGES)),
            (_consumer, (1, q_ptr, out_ptr, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_start,
                         q_len, first, kv_head, n_pre, n_tiles, prefix, qk_scale, stride_qt, stride_qh,
                         stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_N, STAGES)),
            (_producer, (k_desc, v_desc, kc_desc, vc_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                         table_row, q_start, kv_head, n_pre, n_tiles, prefix, PAGE, BLOCK_N, STAGES)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


@functools.cache
def _kv_layout(block_n: int):
    return gl.NVMMASharedLayout.get_default_for([block_n, 1, HEAD_DIM], gl.bfloat16)


def _descriptors(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, block_n: int) -> list:
    """The chunk's K/V by key tiles and the cache's K/V by pages ([blocks * page, KVH, D] views),
    both in the ring slot's layout (a page lands in a slice of a slot)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    page, layout = kv_cache.shape[2], _kv_layout(block_n)
    pages = [c.reshape(-1, *c.shape[2:]) for c in (kv_cache[0], kv_cache[1])]
    return ([TensorDescriptor.from_tensor(t, [block_n, 1, HEAD_DIM], layout) for t in (k, v)]
            + [TensorDescriptor.from_tensor(t, [page, 1, HEAD_DIM], layout) for t in pages])


# The work list where the full grid launches at least this many times its programs. An H100,
# 2026-12-05 (benchmarks/prefill_fa3_ab.py, docs/BENCHMARKS.md), the list then ordered most key
# tiles first: at 17x (20 x 200 after 700, 4 x 900, 128 decodes) it took 414 us against 510; at
# 4.2x (40 x 200 after 700, 128 decodes) 500 against 505; where the grid has no idle programs
# 2-6% longer (9 x 900 189 against 180, 8 x 1,024 199 against 187). An H200, same day, one run:
# in the grid's own order (row by row, `plan_tiles`' default) the list took 440 us against the
# other order's 457 at 4.2x, and 366 against 375 at 17x. Where the grid has no idle programs it
# stayed within -3% to +2.4% of the grid; no step between 1x and 4.2x has been timed.
LIST_MIN_SAVING = 4


def _block_q(group: int) -> int:
    """Query tokens a program takes (the kernel's BLOCK_Q): its 2 x ROWS rows over the group's heads."""
    return 2 * ROWS.value // group


def grid_items(max_query_len: int, num_seqs: int, group: int) -> int:
    """(query tile, sequence) items of the full grid: every row gets as many tiles as the longest."""
    return triton.cdiv(max_query_len, _block_q(group)) * num_seqs


def takes_list(max_query_len: int, num_seqs: int, group: int, num_items: int) -> bool:
    """Whether a launch runs its work list of `num_items` (query tile, sequence) items rather
    than the full grid: the grid's items reach LIST_MIN_SAVING times the list's."""
    return grid_items(max_query_len, num_seqs, group) >= LIST_MIN_SAVING * num_items


def _cdiv(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def _row_tiles(q_lens: np.ndarray, group: int, min_q_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows of at least `min_q_len` query tokens, each one's query tiles)."""
    rows = np.flatnonzero(q_lens >= max(min_q_len, 1))
    return rows, _cdiv(q_lens[rows], _block_q(group))


def count_tiles(query_lens: Sequence[int], group: int, min_q_len: int = 2) -> int:
    """How many items `plan_tiles` would plan: the query tiles of the rows of at least
    `min_q_len` query tokens (so the host can ask `takes_list` before planning any)."""
    return int(_row_tiles(np.asarray(query_lens, dtype=np.int64), group, min_q_len)[1].sum())


def plan_tiles(query_lens: Sequence[int], seq_lens: Sequence[int], group: int, min_q_len: int = 2,
               block_n: int = GluonPrefillConfig.block_n, order: str = "rows") -> np.ndarray:
    """A launch's work items on the host: (sequence, first query token) of every query tile of
    each row of at least `min_q_len` query tokens, as int32 [items, 2], in the full grid's order:
    row by row, each row's tiles counted down, so a row's tiles run back to back as they do
    there. `order="keys"` (benchmarks) puts the items with the most key tiles first instead: 2.5-4%
    slower on an H200 (LIST_MIN_SAVING's comment). The full grid gives every row as many tiles
    as the longest: in a step of short chunks beside a few whole prompts, and one-query rows,
    most of its programs exit at once (35,264 programs, 2,048 of them with work, at 20 x 200
    after 700, 4 x 900 and 128 decodes: 1.28x FA3's time on an H100, docs/BENCHMARKS.md)."""
    if order not in ("keys", "rows"):
        raise ValueError(f"plan_tiles' order is 'keys' or 'rows', got {order!r}")
    block_q = _block_q(group)
    q_lens, totals = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
    rows, counts = _row_tiles(q_lens, group, min_q_len)
    seq = np.repeat(rows, counts)
    first = (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)) * block_q
    if order == "rows":
        ranked = np.lexsort((-first, seq))
    else:
        key_tiles = _cdiv(totals[seq] - q_lens[seq], block_n) + _cdiv(np.minimum(first + block_q, q_lens[seq]), block_n)
        ranked = np.argsort(-key_tiles, kind="stable")
    return np.stack([seq[ranked], first[ranked]], axis=1).astype(np.int32)


def prefill_attention_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                            out: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, scale: float,
                            cached_prefixes: bool = True, min_q_len: int = 2,
                            config: GluonPrefillConfig = GluonPrefillConfig(),
                            tiles: torch.Tensor | None = None) -> torch.Tensor:
    """`prefill_attention_tma`'s contract: causal attention of every sequence's queries over
    its cached prefix and its own chunk (q/out [T, H, D]; k/v [T, KVH, D], this step's new
    keys, also in the cache by now). Sequences whose query is shorter than `min_q_len` are
    left untouched (the decode kernel's one-query rows, the paged kernel's short chunks).
    `cached_prefixes=False` promises no sequence has a prefix (the prefix loop is compiled out).
    `tiles`: `plan_tiles`' items for these rows and `min_q_len` on the device, one program an
    item and KV head, where the full grid over `max_query_len` would launch LIST_MIN_SAVING times
    as many programs or more; else (and without them) the full grid."""
    num_kv_heads = kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    grid = (triton.cdiv(max_query_len, _block_q(group)), num_kv_heads, seq_lens.shape[0])
    if tiles is not None and not takes_list(max_query_len, seq_lens.shape[0], group, tiles.shape[0]):
        tiles = None
    if tiles is not None:
        grid = (tiles.shape[0] * num_kv_heads, 1, 1)
    if grid[0] == 0:
        return out
    _prefill_gluon_kernel[grid](
        q, *_descriptors(k, v, kv_cache, config.block_n), out, block_table, query_start_loc, seq_lens,
        tiles if tiles is not None else seq_lens, scale * LOG2E, min_q_len, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        GROUP=group, HEAD_DIM=HEAD_DIM, PAGE=kv_cache.shape[2], BLOCK_N=config.block_n, STAGES=config.stages,
        HAS_PREFIX=cached_prefixes, LISTED=tiles is not None, NUM_KV_HEADS=num_kv_heads,
        num_warps=CONSUMER_WARPS.value)
    return out
