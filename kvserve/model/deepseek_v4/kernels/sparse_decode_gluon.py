"""DeepSeek V4 sparse decode attention for Hopper, warp-specialized in Gluon (FlashMLA-style).

The planned decode path of `sparse_attention.py` in another form: the plan kernel has resolved
every key of every token to its storage row, and one program per token attends its 64 query
heads x 512 dims over those rows plus the per-head sink. Triton 3.6 builds no warp
specialization on sm_90, so the split is written out in Gluon (`triton.experimental.gluon`,
written against Triton 3.6.0), 12 warps a program:
- a producer warpgroup copies the token's plan (row ids) into shared memory once, gathers Q
  (64 x 512 bf16, kept for the program), then BLOCK_N key rows per tile into a STAGES-deep ring
  by cp.async (Hopper has no TMA gather), CHUNK rows a copy; each producer thread ends a tile
  with `cp.async.mbarrier.arrive.noinc` on the slot's `ready` barrier. Ids of -1 copy nothing;
- two consumer warpgroups (the 64 heads are the wgmma's M): each computes the full
  S = Q K^T and the online softmax (exp2; the sink is the running max's start with weight 1)
  and owns half the output dims for P V (64 x 256 fp32, 128 registers a thread), then arrives
  once on the slot's `empty` barrier. FA3's order (S(j) issued before P(j-1) V(j-1)), as
  `attention/kernels/prefill_gluon.py` runs it, was measured slower here (7-23% on an H100,
  2026-12-05, docs/BENCHMARKS.md) and removed.
The plan lists a token's valid keys first and -1 after them (window keys, then the chosen or
visible entries): keys past the count of valid ids are masked, and a token with none (a
padding row) outputs zeros.

Dim parts (`parts=2`, 8 warps a program): where one program a token leaves SMs idle (64 tokens
on 132 SMs), programs 2t and 2t + 1 each run one consumer warpgroup beside the producer: the full
S (all 512 dims of Q and K are read, as with one part) and P V for their own 256 output dims. No
partials and no reduce: each program stores its half of the output, exactly as a consumer of
the one-part kernel does. Part p gathers Q and the key rows with their dims rotated by p x 256
(shared column d holds dim (d + 256 p) % 512): S = Q K^T is blind to a permutation of the dims
common to both, and the consumer's V is always the slot's first 256 columns, a constexpr slice.
The two programs of a token are neighbours in the grid, so the second's key rows mostly come from
L2. `dim_parts` picks the count from the shapes alone (so CUDA-graph warm-up, capture and replay
agree): two parts while they fit one wave. H100, 640 keys a token (the probe, 2026-12-06): 64
tokens 33.4 -> 25.0 us; 256 tokens 85.7 -> 95.1 us (3.9 waves instead of 2), so one part there.

H200 (`benchmarks/gluon_sparse_decode_probe.py`, "n64 st2", 640 keys a token, 2026-12-04, the probe's
copy of this kernel with int32 row ids):
batch 64 32.4 us (34% of copy bandwidth), 256 80.1 us (55%), 512 154.5 us (57%), against the
Triton planned kernel's 132-158 us at 256 and 65-109 us at 64 (its best configs). No split-KV,
yet below 64 tokens, two programs a token, it also beats the Triton kernel's splits from 8 tokens
on: the CSA decode path as a CUDA graph's replay (as the engine decodes), H100, 2026-12-06, at 32K
and 128K: 16-48 tokens 35-38 us faster, 8 tokens 1.5-2 us faster, 4 tokens 0.7-0.9 us and 1-2
tokens 2.5-3.3 us slower (there the splits' launches are what a graph removes). So the default
configs take this kernel from GLUON_MIN_TOKENS tokens on.

In the engine's decode path (`benchmarks/v4_kernel_bench.py`, batch 256 at 32K, H200, 2026-12-04):
attention 87.6 us against the Triton planned kernel's 133.0, the whole path 285.6 against 331.2 us
(58% and 50% of copy bandwidth over its bytes). On by default, its GPU tests passed on that
device (`tests/test_v4_sparse_gluon.py`); `KVSERVE_GLUON_SPARSE=0` keeps the Triton kernels,
`SparseAttentionConfig(gluon=True)` asks for it explicitly.
"""
from __future__ import annotations

import functools
import logging

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from kvserve.attention.kernels.common import env_switch
from kvserve.attention.kernels.prefill_gluon import ring_barriers
from kvserve.model.deepseek_v4.kernels.pages import sm_count

logger = logging.getLogger(__name__)

HEADS, HEAD_DIM = 64, 512
BLOCK_N, STAGES = 64, 2   # the probe's fastest ("n64 st2"): 2 x 64 KB of ring beside Q's 64 KB
CHUNK = 16                # key rows a cp.async call: 8 16-byte copies a producer thread
MAX_IDS = 2048            # plan ids staged in shared memory (int64: 16 KB); longer key lists: Triton
GLUON_MIN_TOKENS = 8      # the default configs' switch point (measured from 1 to 256 tokens)
ENV = "KVSERVE_GLUON_SPARSE"
CONSUMER_WARPS, PRODUCER_WARPS = gl.constexpr(4), gl.constexpr(4)
PRODUCER_THREADS = gl.constexpr(PRODUCER_WARPS.value * 32)
# setmaxnreg budgets: the kernel starts at 168 a thread for 384 threads; 2 x 128 x 240 +
# 128 x 24 = 168 x 384. The consumers hold O_half (128) + S + P; the producer one chunk's addresses.
CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)
# Two dim parts (8 warps): the kernel starts at 256 a thread for 256 threads (.maxnreg 256: the
# whole 64K register file, ptxas reports 255 used), so nothing is short: the one consumer (the
# default partition) rises to setmaxnreg's ceiling, 256, and the producer keeps 40, where 24 spills
# 4 bytes (the rotated dims' address arithmetic; 32 is the least without spills).
PART_PRODUCER_REGS = gl.constexpr(40)
# Dim parts up to this many tokens (and while 2 programs a token fit one wave of the SMs; 0: one
# part always). H100, 2026-12-06 (docs/BENCHMARKS.md): the kernel alone at 64 tokens 33.4 -> 25.0 us,
# the CSA decode path as a graph 131.9 -> 123.3 us; at 256 tokens two parts were slower (85.7 -> 95.1).
DIM_PARTS_MAX_TOKENS = 66
DIM_PARTS_FORCED: int | None = None   # benchmarks: 1 or 2 for every launch; None: `dim_parts`' rule


_BROKEN = {"reason": None}   # set when the kernel failed to build (a Triton without this Gluon API)


def enabled_by_env() -> bool:
    """On unless KVSERVE_GLUON_SPARSE=0 (A/B runs: the Triton kernels)."""
    return env_switch(ENV, default=True)


def disable(reason: str) -> None:
    logger.warning("Gluon sparse decode kernel switched off (%s): V4 attention runs the Triton kernels", reason)
    _BROKEN["reason"] = reason


def supports(q: torch.Tensor, storage: torch.Tensor, out: torch.Tensor, max_keys: int, row_align: int) -> bool:
    """The shapes this kernel is built for: Hopper, 64 heads x 512 dims in bf16, each token's
    [64, 512] contiguous in q and out, key rows 16-byte aligned (cp.async), at most MAX_IDS keys;
    and it has not failed to build."""
    return (_BROKEN["reason"] is None and q.is_cuda and _is_hopper(q.device.index)
            and tuple(q.shape[1:]) == (HEADS, HEAD_DIM)
            and q.dtype == storage.dtype == out.dtype == torch.bfloat16
            and q.stride(2) == out.stride(2) == 1 and q.stride(1) == out.stride(1) == HEAD_DIM
            and row_align * storage.element_size() % 16 == 0 and storage.data_ptr() % 16 == 0
            and max_keys <= MAX_IDS)


@functools.cache
def _is_hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


@gluon.jit
def _count_valid(plan_ptr, max_keys, IDS_POW2: gl.constexpr):
    """How many of the token's keys are valid (ids >= 0; the plan lists them first)."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    keys = gl.arange(0, IDS_POW2, layout=layout)
    ids = gl.load(plan_ptr + keys, mask=keys < max_keys, other=-1)
    return gl.sum((ids >= 0).to(gl.int32), 0)


@gluon.jit
def _stage_ids(plan_ptr, ids_smem, max_keys, IDS_POW2: gl.constexpr, CHUNK: gl.constexpr):
    """The token's plan into shared memory once: one global round trip instead of one per chunk
    on the producer's critical path. Returned as CHUNK ids a row, taken one row at a time."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [PRODUCER_WARPS], [0])
    keys = gl.arange(0, IDS_POW2, layout=layout)
    ids_smem.store(gl.load(plan_ptr + keys, mask=keys < max_keys, other=-1))
    gl.thread_barrier()   # the producer's warps read each other's ids
    return ids_smem._reinterpret(gl.int64, [IDS_POW2 // CHUNK, CHUNK], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _row_dims(part, PARTS: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """The global dim of each shared column: part p's rows rotated by p x HEAD_DIM / PARTS, so
    that its own output dims sit in the first columns. Whole half rows move: 16-byte copies stay
    16-byte aligned."""
    dims = gl.arange(0, HEAD_DIM, layout=layout)
    if PARTS > 1:
        dims = (dims + part * (HEAD_DIM // PARTS)) % HEAD_DIM
    return dims


@gluon.jit
def _copy_q(q_ptr, q_smem, q_ready, part, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr,
            PARTS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
    dims = _row_dims(part, PARTS, HEAD_DIM, gl.SliceLayout(0, layout))
    for c in gl.static_range(HEADS // CHUNK):
        heads = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        async_copy.async_copy_global_to_shared(q_smem.slice(c * CHUNK, CHUNK), q_ptr + heads[:, None] * HEAD_DIM
                                               + dims[None, :])
    async_copy.mbarrier_arrive(q_ready, increment_count=False)


@gluon.jit
def _gather_tile(storage_ptr, ids_smem, k_buf, j, part, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 CHUNK: gl.constexpr, ROW_ALIGN: gl.constexpr, PARTS: gl.constexpr):
    """Key rows of tile j into one ring slot, CHUNK rows a copy; a plan id is the row's storage
    offset / ROW_ALIGN (a constexpr, so the copies' 16-byte alignment is known); -1 copies zeros."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
    dims = _row_dims(part, PARTS, HEAD_DIM, gl.SliceLayout(0, layout))
    for c in gl.static_range(BLOCK_N // CHUNK):
        ids = ids_smem.index(j * (BLOCK_N // CHUNK) + c).load(gl.SliceLayout(1, layout))
        offs = gl.maximum(ids, 0) * ROW_ALIGN
        async_copy.async_copy_global_to_shared(k_buf.slice(c * CHUNK, CHUNK), storage_ptr + offs[:, None]
                                               + dims[None, :], mask=(ids >= 0)[:, None])


@gluon.jit
def _producer(q_ptr, storage_ptr, plan_ptr, max_keys, n_tiles, part, q_smem, k_smem, ids_smem, q_ready, ready,
              empty, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CHUNK: gl.constexpr, IDS_POW2: gl.constexpr, ROW_ALIGN: gl.constexpr, PARTS: gl.constexpr):
    """One warpgroup: Q, then tile j into slot j % STAGES once every consumer freed it; dims
    rotated for dim part `part` of PARTS."""
    ids_smem = _stage_ids(plan_ptr, ids_smem, max_keys, IDS_POW2, CHUNK)
    _copy_q(q_ptr, q_smem, q_ready, part, HEADS, HEAD_DIM, CHUNK, PARTS)
    for j in range(n_tiles):
        slot = j % STAGES
        # a fresh barrier counts as having finished the phase before 0: the first lap passes
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        _gather_tile(storage_ptr, ids_smem, k_smem.index(slot), j, part, BLOCK_N, HEAD_DIM, CHUNK, ROW_ALIGN,
                     PARTS)
        # fires once this thread's copies have landed; `ready` counts every producer thread
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
    _drain(q_ready, ready, n_tiles, STAGES)


@gluon.jit
def _drain(q_ready, ready, n_tiles, STAGES: gl.constexpr):
    """Wait for the producer's own last copies before its warps exit (no cp.async in flight
    from a finished warp). A `ready` phase only moves on the producer's arrivals."""
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
    return _online_softmax(s, m_i, l_i)


@gluon.jit
def _online_softmax(s, m_i, l_i):
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _attend_tile(wg: gl.constexpr, q_smem, k_buf, m_i, l_i, acc, s_zero, key0, n_valid, qk_scale):
    """S = Q K^T over all 512 dims, softmax, O_half += P V_half; every wgmma waited on."""
    HALF: gl.constexpr = acc.shape[1]
    # cp.async wrote the slot through the generic proxy; wgmma reads it through the async one
    fence_async_shared()
    s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, key0, n_valid, qk_scale)
    acc, p16 = _rescale_and_p16(acc, alpha, p)
    acc = warpgroup_mma(p16, k_buf.slice(wg * HALF, HALF, dim=1), acc, is_async=True)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    return m_i, l_i, acc


@gluon.jit
def _rescale_and_p16(acc, alpha, p):
    """O rescaled to the new running max, and P in bf16 as the PV wgmma's register operand."""
    return _rescale(acc, alpha), _p_operand(p, acc)


@gluon.jit
def _rescale(acc, alpha):
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _p_operand(p, acc):
    """P in bf16 as the A operand of a wgmma accumulating into `acc` (read for its layout only)."""
    o_layout: gl.constexpr = acc.type.layout
    return gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))


@gluon.jit
def _store_out(wg: gl.constexpr, out_ptr, acc, l_i):
    """Normalise and store this consumer's 256 output dims straight from the wgmma layout."""
    HALF: gl.constexpr = acc.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    heads = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, o_layout))
    dims = wg * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + heads[:, None] * (2 * HALF) + dims[None, :], (acc / l_o[:, None]).to(gl.bfloat16))


@gluon.jit
def _consumer_state(sinks_ptr, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """A consumer's start: running max at the sink logit (log2 units) with weight 1, a zero O
    half, and S's zero accumulator operand (ignored by the wgmma)."""
    HALF: gl.constexpr = HEAD_DIM // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HALF, 16])
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.load(sinks_ptr + heads).to(gl.float32) * 1.4426950408889634   # a bf16 model may hold bf16 sinks
    l_i = gl.full([HEADS], 1.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HEADS, HALF], gl.float32, layout=o_layout)
    return m_i, l_i, acc, gl.zeros([HEADS, BLOCK_N], gl.float32, layout=s_layout)


@gluon.jit
def _consumer(wg: gl.constexpr, sinks_ptr, out_ptr, q_smem, k_smem, q_ready, ready, empty, n_valid, n_tiles,
              qk_scale, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr):
    """One warpgroup: all 64 heads x the slot's columns [wg * 256, (wg + 1) * 256) as output dims
    (of `out_ptr`, which a dim part has moved to its own half)."""
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
def shared_state(HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 IDS_POW2: gl.constexpr, ID_TYPE: gl.constexpr, CONSUMERS: gl.constexpr):
    """Shared memory: Q, the key ring, the row ids, and the ring's barriers (`ready` counts every
    producer thread, `empty` one arrival per consumer warpgroup, CONSUMERS of them)."""
    qk_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, HEAD_DIM], gl.bfloat16)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS, HEAD_DIM], qk_layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], k_layout)
    ids_smem = gl.allocate_shared_memory(ID_TYPE, [IDS_POW2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready, ready = ring_barriers(1, PRODUCER_THREADS), ring_barriers(STAGES, PRODUCER_THREADS)
    return q_smem, k_smem, ids_smem, q_ready, ready, ring_barriers(STAGES, CONSUMERS)


@gluon.jit
def _sparse_decode_kernel(q_ptr, storage_ptr, plan_ptr, sinks_ptr, out_ptr, qk_scale, stride_qt, stride_pt,
                          stride_ot, max_keys, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr,
                          MAX_TILES: gl.constexpr, ROW_ALIGN: gl.constexpr, PARTS: gl.constexpr):
    """Program = one token's dim part (PARTS 1: the whole token; 2: programs 2t and 2t + 1, side
    by side). q/out rows are [HEADS, HEAD_DIM] contiguous within a token."""
    t = (gl.program_id(0) // PARTS).to(gl.int64)
    part = gl.program_id(0) % PARTS
    IDS_POW2: gl.constexpr = MAX_TILES * BLOCK_N
    gl.static_assert(BLOCK_N % CHUNK == 0, "a tile is gathered CHUNK rows at a time")
    gl.static_assert(HEADS == 64, "the heads are one warpgroup's wgmma M")
    gl.static_assert(PARTS == 1 or PARTS == 2, "one part (two consumers) or two (one consumer each)")
    plan_ptr += t * stride_pt
    n_valid = _count_valid(plan_ptr, max_keys, IDS_POW2)
    n_tiles = gl.cdiv(n_valid, BLOCK_N)
    q_ptr += t * stride_qt
    out_ptr += t * stride_ot + part * (HEAD_DIM // PARTS)
    q_smem, k_smem, ids_smem, q_ready, ready, empty = shared_state(HEADS, HEAD_DIM, BLOCK_N, STAGES, IDS_POW2,
                                                                   gl.int64, 2 // PARTS)
    # arguments spelled out in place: a tuple bound to a name would turn the constexprs into tensors
    if PARTS == 1:
        gl.warp_specialize([
            (_consumer, (0, sinks_ptr, out_ptr, q_smem, k_smem, q_ready.index(0), ready, empty, n_valid, n_tiles,
                         qk_scale, HEADS, HEAD_DIM, BLOCK_N, STAGES)),
            (_consumer, (1, sinks_ptr, out_ptr, q_smem, k_smem, q_ready.index(0), ready, empty, n_valid, n_tiles,
                         qk_scale, HEADS, HEAD_DIM, BLOCK_N, STAGES)),
            (_producer, (q_ptr, storage_ptr, plan_ptr, max_keys, n_tiles, part, q_smem, k_smem, ids_smem,
                         q_ready.index(0), ready, empty, HEADS, HEAD_DIM, BLOCK_N, STAGES, CHUNK, IDS_POW2,
                         ROW_ALIGN, PARTS)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, sinks_ptr, out_ptr, q_smem, k_smem, q_ready.index(0), ready, empty, n_valid, n_tiles,
                         qk_scale, HEADS, HEAD_DIM, BLOCK_N, STAGES)),
            (_producer, (q_ptr, storage_ptr, plan_ptr, max_keys, n_tiles, part, q_smem, k_smem, ids_smem,
                         q_ready.index(0), ready, empty, HEADS, HEAD_DIM, BLOCK_N, STAGES, CHUNK, IDS_POW2,
                         ROW_ALIGN, PARTS)),
        ], [PRODUCER_WARPS], [PART_PRODUCER_REGS])


def max_tiles(max_keys: int, block_n: int = BLOCK_N) -> int:
    """Tiles of the staged id buffer: a power of two times block_n (gl.arange needs one)."""
    return triton.next_power_of_2(triton.cdiv(max(max_keys, 1), block_n))


def dim_parts(num_tokens: int, num_sms: int) -> int:
    """Programs a token: 2 while two a token still fit one wave of `num_sms` and num_tokens is at
    most DIM_PARTS_MAX_TOKENS, else 1 (DIM_PARTS_FORCED, where set, for every launch). Shapes
    only, never data: a CUDA graph's warm-up, capture and replays launch alike."""
    if DIM_PARTS_FORCED is not None:
        return DIM_PARTS_FORCED
    return 2 if num_tokens <= DIM_PARTS_MAX_TOKENS and 2 * num_tokens <= num_sms else 1


def sparse_decode_gluon(q: torch.Tensor, storage: torch.Tensor, plan: torch.Tensor, row_align: int,
                        sinks: torch.Tensor, qk_scale: float, out: torch.Tensor, block_n: int = BLOCK_N,
                        stages: int = STAGES, parts: int | None = None) -> torch.Tensor:
    """out [T, 64, 512] = attention of q [T, 64, 512] over the plan's keys [T, max_keys] (int64
    storage offsets / row_align, valid first, -1 after) plus one sink logit per head (sinks [64]
    float32); `qk_scale` in log2 units. The caller checked `supports`. `block_n` and `stages`
    are the probe's variants; the defaults are the fastest measured. `parts`: programs a token
    (1 or 2 dim parts); None: `dim_parts`' choice for this many tokens on q's device."""
    num_tokens, max_keys = plan.shape
    if num_tokens == 0:
        return out
    if parts is None:
        parts = dim_parts(num_tokens, sm_count(q.device))
    _sparse_decode_kernel[(num_tokens * parts, )](
        q, storage, plan, sinks, out, qk_scale, q.stride(0), plan.stride(0), out.stride(0), max_keys,
        HEADS=HEADS, HEAD_DIM=HEAD_DIM, BLOCK_N=block_n, STAGES=stages, CHUNK=CHUNK,
        MAX_TILES=max_tiles(max_keys, block_n), ROW_ALIGN=row_align, PARTS=parts,
        num_warps=CONSUMER_WARPS.value)
    return out
