"""A warp-specialized (FlashAttention-3-style) causal prefill kernel for Hopper, in Gluon.

Experimental probe, not used by the engine. Our Triton prefill kernel
(`kvserve/attention/kernels/prefill_tma.py`) runs at ~295 TFLOP/s on 8 x 1,024 tokens and
~460 on 1 x 8,192, FA3 about 1.4x faster; Triton 3.6's `tl.range(..., warp_specialize=True)`
builds no warp specialization on sm_90 (`benchmarks/prefill_ws_probe.py`). FA3's edge is a
producer warp that streams K/V tiles by TMA into a shared-memory ring guarded by mbarriers
while consumer warpgroups run async wgmma and the online softmax. Triton's Gluon dialect
(`triton.experimental.gluon`, written against Triton 3.6.0) lets us write that split by hand.

The problem is `prefill_ws_probe.py`'s: q/out [T, 32, 128] bf16, k/v [T, 8, 128] bf16,
ragged sequences given by `query_start_loc`, causal within each sequence, no cached prefix.
A program owns BLOCK_Q query tokens x the 4 query heads of one KV head (GQA-packed rows,
token-major), so every K/V tile it loads serves all 4 heads. Its warps:
- a producer partition (1 warp): TMA loads of K and V tiles into STAGES-deep rings; it waits
  on each slot's `empty` barrier and arms its `ready` barrier with the tile's bytes;
- two consumer partitions (4 warps, one warpgroup each): each owns half the rows (BLOCK_Q/2
  tokens x 4 heads), keeps its Q tile in shared memory and its O accumulator in registers;
  per key tile: wait K ready, S = Q K^T (wgmma), release K, online softmax (exp2), wait V
  ready, O += P V (wgmma, P from registers), release V. Each slot's `empty` barrier counts
  one arrival per consumer warpgroup. With OVERLAP, S(j) = Q K(j)^T is issued before
  P(j-1) V(j-1), and the softmax of tile j runs while that PV is in flight (FA3's
  intra-warpgroup overlap). No ping-pong ordering between the two warpgroups (FA3's named
  barriers): the warp schedulers interleave them as they will.

    python3 benchmarks/gluon_prefill_probe.py --compile-only   # no GPU (CPU torch is enough): compile
        # every variant for sm_90, print ptxas registers / spills, shared memory and the count of
        # `ttg.warp_specialize` in TTGIR; exits non-zero when a variant fails to compile
    python3 benchmarks/gluon_prefill_probe.py                  # GPU: the production TMA kernel and
        # every variant, each in its own process (a deadlocked ring times out alone), at 8 x 1,024,
        # 2 x 4,096, 1 x 8,192 and RAGGED: checked on NaN-poisoned output against float32 SDPA,
        # then timed with do_bench_cudagraph (us, causal TFLOP/s)
    python3 benchmarks/gluon_prefill_probe.py --variant "q32 n128 st2"   # one variant, in process
"""
from __future__ import annotations

import argparse
import itertools
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from gluon_harness import compile_rows, compile_sm90, compiled_report, run_in_processes
from prefill_headroom import HEADS, KV_HEADS, HEAD_DIM, GROUP, LOG2E, RAGGED, reference

# name -> (BLOCK_Q tokens, BLOCK_N keys, STAGES, OVERLAP); BLOCK_Q * GROUP rows, half a warpgroup each
VARIANTS = {"q32 n128 st2": (32, 128, 2, False), "q32 n128 st2 overlap": (32, 128, 2, True),
            "q32 n64 st3": (32, 64, 3, False), "q32 n64 st3 overlap": (32, 64, 3, True),
            "q32 n64 st4 overlap": (32, 64, 4, True)}
# constexpr, so the jitted code may read them; a consumer is one warpgroup
CONSUMER_WARPS, PRODUCER_WARPS = gl.constexpr(4), gl.constexpr(1)
# setmaxnreg budgets (a multiple of 8): the producer only issues TMA, the consumers hold S and O
CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)


@gluon.jit
def _load_q(q_ptr, q_buf, q_start, q_len, tok0, kv_head, stride_qt, stride_qh,
            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr):
    """Copy this warpgroup's GQA-packed Q rows (token-major x head) into shared memory;
    rows past the sequence are zeros."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [CONSUMER_WARPS, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    tok = tok0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    offs = (q_start + tok).to(gl.int64) * stride_qt + head * stride_qh
    q = gl.load(q_ptr + offs[:, None] + dims[None, :], mask=(tok < q_len)[:, None], other=0.0)
    q_buf.store(q)
    # the wgmma reads Q through the async proxy: order this thread's writes before it
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _softmax_step(s, m_i, l_i, tok, key0, qk_scale, MASK: gl.constexpr):
    """Online softmax of one score tile (keys from key0 on): new max, the rescale of the old
    state, P. Key positions are made here, not carried through the loop: they cost registers."""
    s = s * qk_scale
    if MASK:
        keys = key0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(keys[None, :] <= tok[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _store_out(out_ptr, acc, l_i, q_start, q_len, tok0, kv_head, stride_ot, stride_oh,
               GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr):
    """Normalise and store the rows of this warpgroup that belong to the sequence."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [CONSUMER_WARPS, 1], [1, 0])
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, acc.type.layout))
    out = gl.convert_layout((acc / l_o[:, None]).to(out_ptr.dtype.element_ty), layout)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    tok = tok0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    offs = (q_start + tok).to(gl.int64) * stride_ot + head * stride_oh
    gl.store(out_ptr + offs[:, None] + dims[None, :], out, mask=(tok < q_len)[:, None])


@gluon.jit
def _consumer(wg: gl.constexpr, q_ptr, out_ptr, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
              q_start, q_len, first, kv_head, n_tiles, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, OVERLAP: gl.constexpr):
    """One warpgroup: rows [wg * ROWS, (wg + 1) * ROWS) of the program's tile."""
    ROWS: gl.constexpr = BLOCK_Q // 2 * GROUP
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    tok0 = first + wg * (BLOCK_Q // 2)
    q_buf = q_smem.index(wg)
    _load_q(q_ptr, q_buf, q_start, q_len, tok0, kv_head, stride_qt, stride_qh, GROUP, HEAD_DIM, ROWS)
    tok = tok0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) // GROUP
    m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)   # S's accumulator operand, ignored
    if OVERLAP:
        acc, l_i = _consume_overlapped(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, m_i, l_i, acc,
                                       s_zero, tok, n_tiles, qk_scale, STAGES)
    else:
        acc, l_i = _consume_simple(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, m_i, l_i, acc,
                                   s_zero, tok, n_tiles, qk_scale, STAGES)
    _store_out(out_ptr, acc, l_i, q_start, q_len, tok0, kv_head, stride_ot, stride_oh, GROUP, HEAD_DIM, ROWS)


@gluon.jit
def _k_tile(k_smem, slot, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """K^T of a ring slot: [HEAD_DIM, BLOCK_N], a view (wgmma reads K-major B natively)."""
    return k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))


@gluon.jit
def _v_tile(v_smem, slot, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    return v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])


@gluon.jit
def _pv(p, alpha, acc, v_smem, v_ready, slot, phase, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Rescale O and issue O += P V asynchronously once V's slot is ready. Returns the P
    operand too: its registers must stay untouched until the wait that names it."""
    o_layout: gl.constexpr = acc.type.layout
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p16 = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    mbarrier.wait(v_ready.index(slot), phase)
    return warpgroup_mma(p16, _v_tile(v_smem, slot, BLOCK_N, HEAD_DIM), acc, is_async=True), p16


@gluon.jit
def _qk(q_buf, k_smem, k_ready, s_zero, j, STAGES: gl.constexpr):
    """Issue S = Q K(j)^T asynchronously once K's slot is ready."""
    BLOCK_N: gl.constexpr = s_zero.shape[1]
    HEAD_DIM: gl.constexpr = q_buf.shape[1]
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    return warpgroup_mma(q_buf, _k_tile(k_smem, slot, BLOCK_N, HEAD_DIM), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _simple_step(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, m_i, l_i, acc, s_zero, tok, j,
                 qk_scale, STAGES: gl.constexpr, MASK: gl.constexpr):
    """One key tile, each matrix product waited on before the next step."""
    BLOCK_N: gl.constexpr = s_zero.shape[1]
    HEAD_DIM: gl.constexpr = q_buf.shape[1]
    slot = j % STAGES
    s = warpgroup_mma_wait(0, deps=(_qk(q_buf, k_smem, k_ready, s_zero, j, STAGES), ))
    mbarrier.arrive(k_empty.index(slot))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, tok, j * BLOCK_N, qk_scale, MASK)
    acc, p16 = _pv(p, alpha, acc, v_smem, v_ready, slot, (j // STAGES) & 1, BLOCK_N, HEAD_DIM)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    mbarrier.arrive(v_empty.index(slot))
    return m_i, l_i, acc


@gluon.jit
def _consume_simple(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, m_i, l_i, acc, s_zero,
                    tok, n_tiles, qk_scale, STAGES: gl.constexpr):
    """S, softmax, PV one tile after the other; the last tile holds the diagonal and is masked."""
    for j in range(n_tiles - 1):
        m_i, l_i, acc = _simple_step(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, m_i, l_i, acc,
                                     s_zero, tok, j, qk_scale, STAGES, False)
    m_i, l_i, acc = _simple_step(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, m_i, l_i, acc,
                                 s_zero, tok, n_tiles - 1, qk_scale, STAGES, True)
    return acc, l_i


@gluon.jit
def _overlap_step(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha, m_i, l_i, acc, s_zero,
                  tok, j, qk_scale, STAGES: gl.constexpr, MASK: gl.constexpr):
    """Issue S(j), then P(j-1) V(j-1); the softmax of tile j runs while the PV is in flight."""
    BLOCK_N: gl.constexpr = s_zero.shape[1]
    HEAD_DIM: gl.constexpr = q_buf.shape[1]
    s = _qk(q_buf, k_smem, k_ready, s_zero, j, STAGES)
    prev = (j - 1) % STAGES
    acc, p16 = _pv(p, alpha, acc, v_smem, v_ready, prev, ((j - 1) // STAGES) & 1, BLOCK_N, HEAD_DIM)
    # wgmma groups retire in order: one outstanding means S(j) is done, PV(j-1) may still run
    s = warpgroup_mma_wait(1, deps=(s, ))
    mbarrier.arrive(k_empty.index(j % STAGES))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, tok, j * BLOCK_N, qk_scale, MASK)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    mbarrier.arrive(v_empty.index(prev))
    return p, alpha, m_i, l_i, acc


@gluon.jit
def _consume_overlapped(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, m_i, l_i, acc, s_zero,
                        tok, n_tiles, qk_scale, STAGES: gl.constexpr):
    """FA3's intra-warpgroup overlap: S(j) = Q K(j)^T is issued before P(j-1) V(j-1)."""
    BLOCK_N: gl.constexpr = s_zero.shape[1]
    HEAD_DIM: gl.constexpr = q_buf.shape[1]
    s = warpgroup_mma_wait(0, deps=(_qk(q_buf, k_smem, k_ready, s_zero, 0, STAGES), ))
    mbarrier.arrive(k_empty.index(0))
    # tile 0 is masked whatever it is: causality holds for every tile, the mask only costs time
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, tok, 0, qk_scale, True)
    for j in range(1, n_tiles - 1):
        p, alpha, m_i, l_i, acc = _overlap_step(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha,
                                                m_i, l_i, acc, s_zero, tok, j, qk_scale, STAGES, False)
    if n_tiles > 1:
        p, alpha, m_i, l_i, acc = _overlap_step(q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha,
                                                m_i, l_i, acc, s_zero, tok, n_tiles - 1, qk_scale, STAGES, True)
    last = (n_tiles - 1) % STAGES
    acc, p16 = _pv(p, alpha, acc, v_smem, v_ready, last, ((n_tiles - 1) // STAGES) & 1, BLOCK_N, HEAD_DIM)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    mbarrier.arrive(v_empty.index(last))
    return acc, l_i


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_start, kv_head, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: K(j) then V(j) into ring slot j % STAGES once both consumers freed it.
    Rows past T come back zero; rows of the next sequence are masked by causality."""
    for j in range(n_tiles):
        slot = j % STAGES
        # a fresh barrier counts as having finished the phase before 0: the first lap passes
        phase = ((j // STAGES) & 1) ^ 1
        row = q_start + j * BLOCK_N
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_head, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_head, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, count: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def _gluon_prefill_kernel(q_ptr, k_desc, v_desc, out_ptr, query_start_loc_ptr, qk_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh,
                          GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr):
    """Program (query tile counted down, KV head, sequence)."""
    seq = gl.program_id(2)
    q_tile = gl.num_programs(0) - 1 - gl.program_id(0)   # the longest rows start first
    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    first = q_tile * BLOCK_Q
    gl.static_assert(BLOCK_N % BLOCK_Q == 0, "the diagonal must fall in a query tile's last key tile")
    gl.static_assert(BLOCK_Q % 2 == 0, "two consumer warpgroups split the query tokens")
    if first < q_len:
        kv_head = gl.program_id(1)
        # keys [0, min(first + BLOCK_Q, q_len)); BLOCK_Q <= BLOCK_N puts the diagonal in the last tile
        n_tiles = gl.cdiv(gl.minimum(first + BLOCK_Q, q_len), BLOCK_N)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_Q // 2 * GROUP, HEAD_DIM], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_Q // 2 * GROUP, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        k_ready, v_ready = _ring_barriers(STAGES, 1), _ring_barriers(STAGES, 1)
        k_empty, v_empty = _ring_barriers(STAGES, 2), _ring_barriers(STAGES, 2)   # one arrival per consumer
        # arguments spelled out in place: a tuple bound to a name would turn the constexprs into tensors
        gl.warp_specialize([
            (_consumer, (0, q_ptr, out_ptr, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_start,
                         q_len, first, kv_head, n_tiles, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                         GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, STAGES, OVERLAP)),
            (_consumer, (1, q_ptr, out_ptr, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_start,
                         q_len, first, kv_head, n_tiles, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                         GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, STAGES, OVERLAP)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_start, kv_head,
                         n_tiles, BLOCK_N, STAGES)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def _kv_layout(block_n: int):
    return gl.NVMMASharedLayout.get_default_for([block_n, 1, HEAD_DIM], gl.bfloat16)


def gluon_prefill(q, k, v, out, query_start_loc, max_len: int, scale: float, block_q: int = 32,
                  block_n: int = 128, stages: int = 2, overlap: bool = False):
    """Causal attention of each sequence's tokens over its own; q/out [T, H, D], k/v [T, KVH, D]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    k_desc, v_desc = (TensorDescriptor.from_tensor(t, [block_n, 1, HEAD_DIM], _kv_layout(block_n)) for t in (k, v))
    grid = (triton.cdiv(max_len, block_q), KV_HEADS, query_start_loc.shape[0] - 1)
    _gluon_prefill_kernel[grid](q, k_desc, v_desc, out, query_start_loc, scale * LOG2E,
                                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                                GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK_Q=block_q, BLOCK_N=block_n,
                                STAGES=stages, OVERLAP=overlap, num_warps=CONSUMER_WARPS.value)
    return out


def compile_variant(block_q: int, block_n: int, stages: int, overlap: bool):
    """Compile the kernel for sm_90 without a GPU."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    kv = torch.empty(16, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)   # CPU: only the type matters
    desc = mangle_type(TensorDescriptor.from_tensor(kv, [block_n, 1, HEAD_DIM], _kv_layout(block_n)))
    signature = {"q_ptr": "*bf16", "k_desc": desc, "v_desc": desc, "out_ptr": "*bf16", "query_start_loc_ptr": "*i32",
                 "qk_scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32"}
    constexprs = {"GROUP": GROUP, "HEAD_DIM": HEAD_DIM, "BLOCK_Q": block_q, "BLOCK_N": block_n,
                  "STAGES": stages, "OVERLAP": overlap}
    aligned = ["q_ptr", "out_ptr", "query_start_loc_ptr", "stride_qt", "stride_qh", "stride_ot", "stride_oh"]
    return compile_sm90(_gluon_prefill_kernel, signature, constexprs, aligned, CONSUMER_WARPS.value)


def compile_only() -> int:
    return compile_rows({name: lambda v=v: compile_variant(*v) for name, v in VARIANTS.items()}, 24)


GPU_CASES = ([1024] * 8, [4096] * 2, [8192], RAGGED)
PRODUCTION = "production TMA kernel"
TOLERANCE = 2e-2   # relative error to float32; bf16 P and output land near 4e-3


def case(lengths: list[int], variant: str) -> None:
    """Check one variant against float32 SDPA per sequence on poisoned output, then time it."""
    import torch
    from triton.testing import do_bench_cudagraph
    from kvserve.attention.kernels.prefill_tma import prefill_attention_tma
    from prefill_headroom import ragged_cache
    torch.manual_seed(0)
    total, top, scale = sum(lengths), max(lengths), HEAD_DIM ** -0.5
    q = torch.randn(total, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, total, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda").unbind(0)
    starts = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    ref = torch.cat([reference(q[a:b], k[a:b], v[a:b], 1, b - a).transpose(1, 2).reshape(b - a, HEADS, HEAD_DIM)
                     for a, b in itertools.pairwise(starts.tolist())])
    out = torch.full_like(q, float("nan"))   # poisoned: a row the kernel skips shows in the error
    if variant == PRODUCTION:
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        cache, table = ragged_cache(k, v, lengths)
        fn = lambda: prefill_attention_tma(q, k, v, cache, out, table, starts, lens, top, scale,  # noqa: E731
                                           cached_prefixes=False)
    else:
        fn = lambda: gluon_prefill(q, k, v, out, starts, top, scale, *VARIANTS[variant])  # noqa: E731
    label = f"{len(lengths)} seqs / {total} tokens / max {top}"
    try:
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        torch.cuda.synchronize()
        verdict = "ok" if err < TOLERANCE else "WRONG"   # nan compares false: WRONG
        ms = do_bench_cudagraph(fn, rep=100)
        flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) // 2 for n in lengths)
        print(f"{variant:<24} {label:<34} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s  "
              f"rel err {err:.1e} {verdict}", flush=True)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a row
        print(f"{variant:<24} {label:<34} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)


def run_variant(variant: str) -> None:
    import torch
    for lengths in GPU_CASES:
        case(lengths, variant)
    if variant != PRODUCTION and torch.cuda.is_initialized():
        print(f"{variant:<24} compiled: {compiled_report(_gluon_prefill_kernel)}", flush=True)


def run_all(timeout_s: int) -> int:
    return run_in_processes(__file__, [PRODUCTION, *VARIANTS], timeout_s, 24)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report; no GPU needed")
    p.add_argument("--variant", choices=[PRODUCTION, *VARIANTS], help="run one variant in this process")
    p.add_argument("--timeout", type=int, default=240, help="seconds a variant's process may take")
    args = p.parse_args()
    if args.compile_only:
        sys.exit(compile_only())
    if args.variant:
        run_variant(args.variant)
    else:
        sys.exit(run_all(args.timeout))


if __name__ == "__main__":
    main()
