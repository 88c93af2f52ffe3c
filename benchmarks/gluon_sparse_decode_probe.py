"""A warp-specialized (FlashMLA-style) DeepSeek-V4 sparse decode attention kernel for Hopper, in Gluon.

Experimental probe, not used by the engine. Our Triton kernel
(`kvserve/model/deepseek_v4/kernels/sparse_attention.py`, planned path, block_n 64, one split)
reads its bytes at ~29% of copy bandwidth at batch 256 (134 us): one 8-warp program per SM
holding a 64 x 512 fp32 accumulator is latency-bound (2 warps per scheduler, 70% of cycles
issue nothing). FlashMLA's sparse decode gets near bandwidth by warp specialization: producer
warps gather the selected key rows into shared memory while consumer warpgroups compute.
Triton 3.6 builds no automatic warp specialization on sm_90, so this writes it out in Gluon
(`triton.experimental.gluon`, written against Triton 3.6.0).

The problem (one query token per sequence): q [T, 64, 512] bf16; one shared K = V head whose
row r is storage[r, :512] (bf16, a gather by row id: in production rows sit anywhere in a paged
pool); rows [T, max_keys] int32 lists each token's keys, valid ids first, then -1; sinks [64]
float32, one extra logit per head with a zero value row. out[t, h] = softmax over the token's
keys plus the sink of (512 ** -0.5 * q.k), times the key rows. A token with no key outputs zeros.

One program per token, 12 warps:
- a producer partition (one warpgroup): copies the token's row ids into shared memory, gathers
  Q (64 x 512 bf16, 64 KB, kept for the whole program) and then BLOCK_N key rows per tile into a
  STAGES-deep ring by cp.async (Hopper has no TMA gather), CHUNK rows per copy so the pointer
  tensor stays small. Each producer thread ends a tile with `cp.async.mbarrier.arrive.noinc` on
  the slot's `ready` barrier (count = producer threads), which fires when its copies land.
  Invalid keys (-1) copy nothing (zero fill) and their logits are masked to -inf;
- two consumer partitions (one warpgroup each, the 64 heads are the wgmma's M = 64). The
  64 x 512 fp32 output needs 256 registers a thread in one warpgroup, so each consumer owns
  half of the output dims (64 x 256 fp32, 128 registers). Both compute the full S = Q K^T
  (64 x BLOCK_N over the 512-dim contraction) and the same online softmax: no cross-warpgroup
  exchange of partial scores or P, so no extra barriers or shared memory, the simplest to get
  right. The price is tensor time: 192 wgmma FLOP per key byte instead of 128, near H200's
  ridge (~990 TFLOP/s / 4.8 TB/s ~ 206), so at M = 64 the tensor cores may co-limit; the next
  step, if they do, is a split-S variant (each consumer S over its 256 dims, partial S swapped
  through shared memory, 8-16 KB a slot). Per tile: wait `ready`, fence (cp.async writes are generic-proxy
  writes, wgmma reads through the async proxy), S by wgmma, softmax (exp2, sink as the initial
  running max with weight 1), O_half += P V_half (P from registers, V = the same smem tile,
  sliced to the consumer's 256 columns), then arrive once on the slot's `empty` barrier
  (count 2: one per consumer). The producer waits `empty` before refilling a slot.
Shared memory: Q 64 KB + STAGES x BLOCK_N KB + the row ids (4 KB) must fit 227 KB.

First run (H200, 2026-12-04, docs/BENCHMARKS.md): all correct; "n64 st2" at batch 256 read its
bytes at 53.9% of copy (81 us; the production Triton kernel: 29%), at batch 64 at 34% (64
programs on 132 SMs). At one program a token, each token pays its Q load and the ring's fill
alone: a program holds 201 KB of shared memory, so an SM runs one at a time. The persistent
variants (not yet run on a GPU) keep one program an SM walking tokens pid, pid + programs, ...
through one ring: each consumer hands Q back (`q_empty`, count 2) once its last S has read it,
the producer then loads the next token's Q and tiles while the consumers finish the last PV and
store; ring slots and phases run on across tokens (tile counter g, token counter i).

    python3 benchmarks/gluon_sparse_decode_probe.py --compile-only   # no GPU: compile every variant
        # for sm_90, print ptxas registers / spills, shared memory and the count of
        # `ttg.warp_specialize` in TTGIR; exits non-zero when a variant fails to compile
    python3 benchmarks/gluon_sparse_decode_probe.py                  # GPU: every variant in its own
        # process (a deadlocked ring times out alone) at batch 64, 256, 512: checked on NaN-poisoned
        # output against a float32 reference, then timed with do_bench_cudagraph (us, GB/s, share
        # of the measured copy bandwidth)
    python3 benchmarks/gluon_sparse_decode_probe.py --variant "n64 st2"   # one variant, in process
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from gluon_harness import compile_rows, compile_sm90, compiled_report, probe_main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # kvserve, when not installed
from kvserve.attention.kernels.prefill_gluon import ring_barriers  # noqa: E402

HEADS, HEAD_DIM = 64, 512
WINDOW_KEYS, CHOSEN_KEYS = 128, 512
MAX_KEYS = WINDOW_KEYS + CHOSEN_KEYS
LOG2E = math.log2(math.e)
# name -> (BLOCK_N key rows per ring slot, STAGES, PERSISTENT); a slot holds BLOCK_N KB. A
# persistent program walks tokens pid, pid + programs, ... with one ring for all of them: the
# next token's Q and first tiles load while the consumers finish the last one's (module doc).
VARIANTS = {"n64 st2": (64, 2, False), "n32 st4": (32, 4, False), "n32 st2": (32, 2, False),
            "n64 st2 persistent": (64, 2, True), "n32 st4 persistent": (32, 4, True)}
CHUNK = 16   # key rows per cp.async call: 16 x 512 bf16 over a warpgroup is 8 16-byte copies a thread
# constexpr, so the jitted code may read them; every partition is one warpgroup
CONSUMER_WARPS, PRODUCER_WARPS = gl.constexpr(4), gl.constexpr(4)
PRODUCER_THREADS = gl.constexpr(PRODUCER_WARPS.value * 32)
# setmaxnreg budgets (multiples of 8): the kernel starts at 168 a thread for 384 threads, so
# 2 x 128 x 240 + 128 x 24 = 168 x 384 uses the whole pool. The consumers hold O_half (128) + S
# (BLOCK_N / 2) + P and spill at 224 with BLOCK_N 64; the producer only one chunk's addresses.
CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)


@gluon.jit
def _count_valid(rows_ptr, max_keys, IDS_POW2: gl.constexpr):
    """How many of the token's keys are valid (ids >= 0; they come first)."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    keys = gl.arange(0, IDS_POW2, layout=layout)
    ids = gl.load(rows_ptr + keys, mask=keys < max_keys, other=-1)
    return gl.sum((ids >= 0).to(gl.int32), 0)


@gluon.jit
def _stage_ids(rows_ptr, ids_smem, max_keys, IDS_POW2: gl.constexpr, CHUNK: gl.constexpr):
    """The token's row ids into shared memory once: one global round trip instead of one per
    chunk on the producer's critical path."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [PRODUCER_WARPS], [0])
    keys = gl.arange(0, IDS_POW2, layout=layout)
    ids_smem.store(gl.load(rows_ptr + keys, mask=keys < max_keys, other=-1))
    gl.thread_barrier()   # the producer's warps read each other's ids
    # the same bytes (unswizzled, row-major) as a CHUNK of ids a row, taken one by one; a rank-1
    # layout, as `index` keeps the layout (so the barriers' [STAGES, 1] arrays have one too)
    return ids_smem._reinterpret(gl.int32, [IDS_POW2 // CHUNK, CHUNK], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _copy_q(q_ptr, q_smem, q_ready, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(HEADS // CHUNK):
        heads = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        async_copy.async_copy_global_to_shared(q_smem.slice(c * CHUNK, CHUNK), q_ptr + heads[:, None] * HEAD_DIM
                                               + dims[None, :])
    async_copy.mbarrier_arrive(q_ready, increment_count=False)


@gluon.jit
def _gather_tile(storage_ptr, stride_sr, ids_smem, k_buf, j, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 CHUNK: gl.constexpr):
    """Key rows of tile j into one ring slot, CHUNK rows per copy; -1 rows copy nothing (zeros)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(BLOCK_N // CHUNK):
        ids = ids_smem.index(j * (BLOCK_N // CHUNK) + c).load(gl.SliceLayout(1, layout))
        offs = gl.maximum(ids, 0).to(gl.int64) * stride_sr
        async_copy.async_copy_global_to_shared(k_buf.slice(c * CHUNK, CHUNK), storage_ptr + offs[:, None]
                                               + dims[None, :], mask=(ids >= 0)[:, None])


@gluon.jit
def _producer(q_ptr, storage_ptr, rows_ptr, stride_sr, max_keys, n_tiles, q_smem, k_smem, ids_smem, q_ready,
              ready, empty, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CHUNK: gl.constexpr, IDS_POW2: gl.constexpr):
    """One warpgroup: Q, then tile j into slot j % STAGES once both consumers freed it."""
    ids_smem = _stage_ids(rows_ptr, ids_smem, max_keys, IDS_POW2, CHUNK)
    _copy_q(q_ptr, q_smem, q_ready, HEADS, HEAD_DIM, CHUNK)
    for j in range(n_tiles):
        slot = j % STAGES
        # a fresh barrier counts as having finished the phase before 0: the first lap passes
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        _gather_tile(storage_ptr, stride_sr, ids_smem, k_smem.index(slot), j, BLOCK_N, HEAD_DIM, CHUNK)
        # fires once this thread's copies have landed; `ready` counts every producer thread
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
    _drain(q_ready, ready, n_tiles, STAGES)


@gluon.jit
def _drain(q_ready, ready, n_tiles, STAGES: gl.constexpr):
    """Wait for the producer's own last copies before its warps exit: the consumers wait for them
    anyway, this only keeps no cp.async in flight from a finished warp. A `ready` phase only moves
    on the producer's arrivals, so the last one stays complete."""
    mbarrier.wait(q_ready, 0)
    if n_tiles > 0:
        last = n_tiles - 1
        mbarrier.wait(ready.index(last % STAGES), (last // STAGES) & 1)


@gluon.jit
def _softmax_step(s, m_i, l_i, key0, n_valid, qk_scale):
    """Online softmax of one score tile (log2 units): new max, the rescale of the old state, P.
    m_i starts at the sink logit with l_i = 1, so the max is always finite and -inf keys give 0."""
    keys = key0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
    s = gl.where(keys[None, :] < n_valid, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _attend_tile(wg: gl.constexpr, q_smem, k_buf, m_i, l_i, acc, s_zero, key0, n_valid, qk_scale):
    """S = Q K^T over all 512 dims, softmax, O_half += P V_half; every wgmma waited on."""
    HALF: gl.constexpr = acc.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    # cp.async wrote the slot through the generic proxy; wgmma reads it through the async one
    fence_async_shared()
    s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, key0, n_valid, qk_scale)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p16 = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    acc = warpgroup_mma(p16, k_buf.slice(wg * HALF, HALF, dim=1), acc, is_async=True)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    return m_i, l_i, acc


@gluon.jit
def _store_out(wg: gl.constexpr, out_ptr, acc, l_i):
    """Normalise and store this consumer's 256 output dims straight from the wgmma layout (the
    output is a tenth of the bytes read; a layout change would need 32 KB of scratch)."""
    HALF: gl.constexpr = acc.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    heads = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, o_layout))
    dims = wg * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + heads[:, None] * (2 * HALF) + dims[None, :], (acc / l_o[:, None]).to(gl.bfloat16))


@gluon.jit
def _consumer_state(sinks_ptr, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """A consumer's start on a token: running max at the sink logit (log2 units) with weight 1,
    a zero O half, and S's zero accumulator operand (ignored by the wgmma)."""
    HALF: gl.constexpr = HEAD_DIM // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HALF, 16])
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.load(sinks_ptr + heads) * 1.4426950408889634
    l_i = gl.full([HEADS], 1.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HEADS, HALF], gl.float32, layout=o_layout)
    return m_i, l_i, acc, gl.zeros([HEADS, BLOCK_N], gl.float32, layout=s_layout)


@gluon.jit
def _consumer(wg: gl.constexpr, sinks_ptr, out_ptr, q_smem, k_smem, q_ready, ready, empty, n_valid, n_tiles,
              qk_scale, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr):
    """One warpgroup: all 64 heads x output dims [wg * 256, (wg + 1) * 256)."""
    m_i, l_i, acc, s_zero = _consumer_state(sinks_ptr, HEADS, HEAD_DIM, BLOCK_N)
    mbarrier.wait(q_ready, 0)
    for j in range(n_tiles):
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        m_i, l_i, acc = _attend_tile(wg, q_smem, k_smem.index(slot), m_i, l_i, acc, s_zero, j * BLOCK_N,
                                     n_valid, qk_scale)
        mbarrier.arrive(empty.index(slot))
    _store_out(wg, out_ptr, acc, l_i)


@gluon.jit
def _shared(HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            IDS_POW2: gl.constexpr):
    """Both kernels' shared memory: Q, the key ring, the row ids, and the ring's barriers
    (`ready` counts every producer thread, `empty` one arrival per consumer warpgroup)."""
    qk_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, HEAD_DIM], gl.bfloat16)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, HEAD_DIM], qk_layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], k_layout)
    ids_smem = gl.allocate_shared_memory(gl.int32, [IDS_POW2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready, ready = ring_barriers(1, PRODUCER_THREADS), ring_barriers(STAGES, PRODUCER_THREADS)
    return q_smem, k_smem, ids_smem, q_ready, ready, ring_barriers(STAGES, 2)


@gluon.jit
def _sparse_decode_kernel(q_ptr, storage_ptr, rows_ptr, sinks_ptr, out_ptr, qk_scale, stride_qt, stride_sr,
                          stride_rt, stride_ot, max_keys, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr,
                          MAX_TILES: gl.constexpr):
    """Program = one token. q/out rows are [HEADS, HEAD_DIM] contiguous within a token."""
    t = gl.program_id(0).to(gl.int64)
    IDS_POW2: gl.constexpr = MAX_TILES * BLOCK_N
    gl.static_assert(BLOCK_N % CHUNK == 0, "a tile is gathered CHUNK rows at a time")
    gl.static_assert(HEADS == 64, "the heads are one warpgroup's wgmma M")
    rows_ptr += t * stride_rt
    n_valid = _count_valid(rows_ptr, max_keys, IDS_POW2)
    n_tiles = gl.cdiv(n_valid, BLOCK_N)
    q_ptr += t * stride_qt
    out_ptr += t * stride_ot
    q_smem, k_smem, ids_smem, q_ready, ready, empty = _shared(HEADS, HEAD_DIM, BLOCK_N, STAGES, IDS_POW2)
    # arguments spelled out in place: a tuple bound to a name would turn the constexprs into tensors
    gl.warp_specialize([
        (_consumer, (0, sinks_ptr, out_ptr, q_smem, k_smem, q_ready.index(0), ready, empty, n_valid, n_tiles,
                     qk_scale, HEADS, HEAD_DIM, BLOCK_N, STAGES)),
        (_consumer, (1, sinks_ptr, out_ptr, q_smem, k_smem, q_ready.index(0), ready, empty, n_valid, n_tiles,
                     qk_scale, HEADS, HEAD_DIM, BLOCK_N, STAGES)),
        (_producer, (q_ptr, storage_ptr, rows_ptr, stride_sr, max_keys, n_tiles, q_smem, k_smem, ids_smem,
                     q_ready.index(0), ready, empty, HEADS, HEAD_DIM, BLOCK_N, STAGES, CHUNK, IDS_POW2)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _consume_token(wg: gl.constexpr, sinks_ptr, out_ptr, q_smem, k_smem, q_ready, q_empty, ready, empty,
                   n_valid, g, i, qk_scale, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr):
    """One token of a persistent program: tiles g, g + 1, ... of the ring, its Q in phase i;
    Q is handed back (`q_empty`) once this consumer's last S has read it."""
    m_i, l_i, acc, s_zero = _consumer_state(sinks_ptr, HEADS, HEAD_DIM, BLOCK_N)
    n_tiles = gl.cdiv(n_valid, BLOCK_N)
    mbarrier.wait(q_ready, i & 1)
    for j in range(n_tiles):
        slot = (g + j) % STAGES
        mbarrier.wait(ready.index(slot), ((g + j) // STAGES) & 1)
        m_i, l_i, acc = _attend_tile(wg, q_smem, k_smem.index(slot), m_i, l_i, acc, s_zero, j * BLOCK_N,
                                     n_valid, qk_scale)
        if j == n_tiles - 1:   # S waited on inside: this consumer is done with Q
            mbarrier.arrive(q_empty)
        mbarrier.arrive(empty.index(slot))
    if n_tiles == 0:
        mbarrier.arrive(q_empty)
    _store_out(wg, out_ptr, acc, l_i)
    return g + n_tiles


@gluon.jit
def _consumer_persistent(wg: gl.constexpr, rows_ptr, sinks_ptr, out_ptr, q_smem, k_smem, q_ready, q_empty, ready,
                         empty, num_tokens, stride_rt, stride_ot, max_keys, qk_scale, HEADS: gl.constexpr,
                         HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         IDS_POW2: gl.constexpr):
    g = 0
    i = 0
    for t in range(gl.program_id(0), num_tokens, gl.num_programs(0)):
        n_valid = _count_valid(rows_ptr + t.to(gl.int64) * stride_rt, max_keys, IDS_POW2)
        g = _consume_token(wg, sinks_ptr, out_ptr + t.to(gl.int64) * stride_ot, q_smem, k_smem, q_ready, q_empty,
                           ready, empty, n_valid, g, i, qk_scale, HEADS, HEAD_DIM, BLOCK_N, STAGES)
        i += 1


@gluon.jit
def _produce_token(q_ptr, storage_ptr, rows_ptr, stride_sr, max_keys, q_smem, k_smem, ids_smem, q_ready, q_empty,
                   ready, empty, g, i, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, CHUNK: gl.constexpr, IDS_POW2: gl.constexpr):
    """One token of a persistent program: its Q once both consumers handed the last back, then
    its tiles into ring slots g, g + 1, ...; returns the next tile's ring index."""
    n_tiles = gl.cdiv(_count_valid(rows_ptr, max_keys, IDS_POW2), BLOCK_N)
    mbarrier.wait(q_empty, (i & 1) ^ 1)
    gl.thread_barrier()   # every producer thread has read the last token's ids before they change
    ids = _stage_ids(rows_ptr, ids_smem, max_keys, IDS_POW2, CHUNK)
    _copy_q(q_ptr, q_smem, q_ready, HEADS, HEAD_DIM, CHUNK)
    for j in range(n_tiles):
        slot = (g + j) % STAGES
        mbarrier.wait(empty.index(slot), (((g + j) // STAGES) & 1) ^ 1)
        _gather_tile(storage_ptr, stride_sr, ids, k_smem.index(slot), j, BLOCK_N, HEAD_DIM, CHUNK)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
    return g + n_tiles


@gluon.jit
def _producer_persistent(q_ptr, storage_ptr, rows_ptr, stride_qt, stride_sr, stride_rt, max_keys, num_tokens,
                         q_smem, k_smem, ids_smem, q_ready, q_empty, ready, empty, HEADS: gl.constexpr,
                         HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         CHUNK: gl.constexpr, IDS_POW2: gl.constexpr):
    g = 0
    i = 0
    for t in range(gl.program_id(0), num_tokens, gl.num_programs(0)):
        g = _produce_token(q_ptr + t.to(gl.int64) * stride_qt, storage_ptr, rows_ptr + t.to(gl.int64) * stride_rt,
                           stride_sr, max_keys, q_smem, k_smem, ids_smem, q_ready, q_empty, ready, empty, g, i,
                           HEADS, HEAD_DIM, BLOCK_N, STAGES, CHUNK, IDS_POW2)
        i += 1
    async_copy.commit_group()   # wait_group waits on committed groups: this one holds every copy left
    async_copy.wait_group(0)    # no cp.async in flight from a finished warp


@gluon.jit
def _sparse_decode_persistent_kernel(q_ptr, storage_ptr, rows_ptr, sinks_ptr, out_ptr, qk_scale, stride_qt,
                                     stride_sr, stride_rt, stride_ot, max_keys, num_tokens, HEADS: gl.constexpr,
                                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                     CHUNK: gl.constexpr, MAX_TILES: gl.constexpr):
    """Program = tokens pid, pid + programs, ...; shared memory as the per-token kernel's."""
    IDS_POW2: gl.constexpr = MAX_TILES * BLOCK_N
    gl.static_assert(BLOCK_N % CHUNK == 0, "a tile is gathered CHUNK rows at a time")
    gl.static_assert(HEADS == 64, "the heads are one warpgroup's wgmma M")
    q_smem, k_smem, ids_smem, q_ready, ready, empty = _shared(HEADS, HEAD_DIM, BLOCK_N, STAGES, IDS_POW2)
    q_empty = ring_barriers(1, 2)   # one arrival per consumer warpgroup
    gl.warp_specialize([
        (_consumer_persistent, (0, rows_ptr, sinks_ptr, out_ptr, q_smem, k_smem, q_ready.index(0), q_empty.index(0),
                                ready, empty, num_tokens, stride_rt, stride_ot, max_keys, qk_scale, HEADS, HEAD_DIM,
                                BLOCK_N, STAGES, IDS_POW2)),
        (_consumer_persistent, (1, rows_ptr, sinks_ptr, out_ptr, q_smem, k_smem, q_ready.index(0), q_empty.index(0),
                                ready, empty, num_tokens, stride_rt, stride_ot, max_keys, qk_scale, HEADS, HEAD_DIM,
                                BLOCK_N, STAGES, IDS_POW2)),
        (_producer_persistent, (q_ptr, storage_ptr, rows_ptr, stride_qt, stride_sr, stride_rt, max_keys, num_tokens,
                                q_smem, k_smem, ids_smem, q_ready.index(0), q_empty.index(0), ready, empty, HEADS,
                                HEAD_DIM, BLOCK_N, STAGES, CHUNK, IDS_POW2)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def _max_tiles(max_keys: int, block_n: int) -> int:
    """Tiles of the padded id buffer: a power of two times BLOCK_N (gl.arange needs one)."""
    return triton.next_power_of_2(triton.cdiv(max_keys, block_n))


def gluon_sparse_decode(q, storage, rows, sinks, out, scale: float, block_n: int = 64, stages: int = 2,
                        persistent: bool = False):
    """out [T, 64, 512] = attention of q [T, 64, 512] over storage rows `rows` [T, max_keys]
    (valid ids first, -1 after) plus one sink logit per head, sinks [64] float32. `persistent`:
    one program an SM, walking tokens."""
    num_tokens, max_keys = rows.shape
    if q.stride(2) != 1 or q.stride(1) != HEAD_DIM or out.stride(2) != 1 or out.stride(1) != HEAD_DIM:
        raise ValueError("q and out need contiguous [64, 512] rows per token")
    if storage.stride(1) != 1 or rows.stride(1) != 1:
        raise ValueError("storage rows and the row ids must be contiguous")
    args = (q, storage, rows, sinks, out, scale * LOG2E, q.stride(0), storage.stride(0), rows.stride(0),
            out.stride(0), max_keys)
    meta = dict(HEADS=HEADS, HEAD_DIM=HEAD_DIM, BLOCK_N=block_n, STAGES=stages, CHUNK=CHUNK,
                MAX_TILES=_max_tiles(max_keys, block_n), num_warps=CONSUMER_WARPS.value)
    if persistent:
        import torch
        programs = min(num_tokens, torch.cuda.get_device_properties(q.device).multi_processor_count)
        _sparse_decode_persistent_kernel[(programs, )](*args, num_tokens, **meta)
    else:
        _sparse_decode_kernel[(num_tokens, )](*args, **meta)
    return out


# ---------------------------------------------------------------- compile-only (no GPU)

def compile_variant(block_n: int, stages: int, persistent: bool):
    """Compile the kernel for sm_90 without a GPU, specialized as a launch on MAX_KEYS would be."""
    signature = {"q_ptr": "*bf16", "storage_ptr": "*bf16", "rows_ptr": "*i32", "sinks_ptr": "*fp32",
                 "out_ptr": "*bf16", "qk_scale": "fp32", "stride_qt": "i32", "stride_sr": "i32", "stride_rt": "i32",
                 "stride_ot": "i32", "max_keys": "i32"}
    if persistent:
        signature["num_tokens"] = "i32"
    constexprs = {"HEADS": HEADS, "HEAD_DIM": HEAD_DIM, "BLOCK_N": block_n, "STAGES": stages, "CHUNK": CHUNK,
                  "MAX_TILES": _max_tiles(MAX_KEYS, block_n)}
    aligned = [n for n in signature if n.endswith("_ptr") or n.startswith("stride_") or n == "max_keys"]
    kernel = _sparse_decode_persistent_kernel if persistent else _sparse_decode_kernel
    return compile_sm90(kernel, signature, constexprs, aligned, CONSUMER_WARPS.value)


def compile_only() -> int:
    return compile_rows({name: lambda v=v: compile_variant(*v) for name, v in VARIANTS.items()}, 20)


# ---------------------------------------------------------------- GPU check and timing

BATCHES = (64, 256, 512)   # 512: four tokens a persistent program, the ring and Q phases wrap
STORAGE_ROWS = 1 << 20   # 1 GiB of key rows: random gathers miss L2 (50 MB) as in production
TOLERANCE = 2e-2   # relative error to float32; bf16 P and output land near 4e-3


def make_inputs(batch: int):
    """Random q, storage, sinks and row ids: most tokens have all 640 keys, every 5th a random
    shorter list (-1 tail), the last none."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(batch)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    storage = torch.randn(STORAGE_ROWS, HEAD_DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    sinks = torch.randn(HEADS, dtype=torch.float32, device="cuda", generator=gen)
    rows = torch.randint(0, STORAGE_ROWS, (batch, MAX_KEYS), dtype=torch.int32, device="cuda", generator=gen)
    counts = torch.full((batch, ), MAX_KEYS, dtype=torch.int64, device="cuda")
    counts[3::5] = torch.randint(1, MAX_KEYS, counts[3::5].shape, device="cuda", generator=gen)
    counts[-1] = 0
    rows.masked_fill_(torch.arange(MAX_KEYS, device="cuda")[None, :] >= counts[:, None], -1)
    return q, storage, rows, sinks


def reference(q, storage, rows, sinks, scale: float):
    """float32 softmax over each token's valid keys plus the sink column, which is then dropped."""
    import torch
    keys = storage[rows.clamp(min=0).long()].float()   # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill((rows < 0)[:, None, :], float("-inf"))
    sink = sinks[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys)


def _check_reference(q, storage, rows, sinks, ref, scale: float) -> None:
    """The reference agrees with the engine's torch V4 sink attention on a short-list token."""
    from kvserve.attention.v4_torch_ref import sink_attention
    t = 3
    keys = storage[rows[t].clamp(min=0).long()].float()
    other = sink_attention(q[t:t + 1].float(), keys, (rows[t] >= 0)[None, :], sinks, scale)[0]
    err = ((other - ref[t]).norm() / ref[t].norm()).item()
    if err > 1e-3:
        raise RuntimeError(f"the harness reference disagrees with v4_torch_ref.sink_attention: {err:.1e}")


def bytes_read(q, rows) -> int:
    """Valid key rows x 1 KB + q + out (written) + the row ids."""
    return int((rows >= 0).sum().item()) * HEAD_DIM * 2 + 2 * q.numel() * 2 + rows.numel() * 4


def case(batch: int, variant: str, copy_gbs: float) -> None:
    """Check one variant against the float32 reference on NaN-poisoned output, then time it."""
    import torch
    from triton.testing import do_bench_cudagraph
    scale = HEAD_DIM ** -0.5
    q, storage, rows, sinks = make_inputs(batch)
    ref = reference(q, storage, rows, sinks, scale)
    label = f"batch {batch}"
    try:
        _check_reference(q, storage, rows, sinks, ref, scale)
        out = torch.full_like(q, float("nan"))   # poisoned: a row the kernel skips shows in the error
        fn = lambda: gluon_sparse_decode(q, storage, rows, sinks, out, scale, *VARIANTS[variant])  # noqa: E731
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        empty_ok = bool((out[-1] == 0).all())   # the token without keys
        torch.cuda.synchronize()
        verdict = "ok" if err < TOLERANCE and empty_ok else "WRONG"   # nan compares false: WRONG
        ms = do_bench_cudagraph(fn, rep=100)
        gbs = bytes_read(q, rows) / ms / 1e6
        print(f"{variant:<20} {label:<10} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s {gbs / copy_gbs:5.1%} of copy  "
              f"rel err {err:.1e} empty token {'zeros' if empty_ok else 'NOT zeros'} {verdict}", flush=True)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a row
        print(f"{variant:<20} {label:<10} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)


def run_variant(variant: str) -> None:
    import torch
    from kvserve.bench.kernels import copy_bandwidth_gbs
    copy_gbs = copy_bandwidth_gbs(1 << 30)
    print(f"{variant:<20} device copy bandwidth {copy_gbs:.0f} GB/s (read + write of 1 GiB)", flush=True)
    for batch in BATCHES:
        case(batch, variant, copy_gbs)
    if torch.cuda.is_initialized():
        kernel = _sparse_decode_persistent_kernel if VARIANTS[variant][2] else _sparse_decode_kernel
        print(f"{variant:<20} compiled: {compiled_report(kernel)}", flush=True)


if __name__ == "__main__":
    probe_main(__file__, __doc__, list(VARIANTS), run_variant, compile_only, 20)
