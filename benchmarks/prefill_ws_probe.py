"""Does Triton's warp specialization reach the TMA prefill kernel on Hopper?

FA3 keeps the H200's tensor cores fed by splitting a program's warps into a producer (TMA
loads) and consumer warp groups whose softmax overlaps the other's matrix products; our
Triton kernels have no such split, and the served mixed burst's attention takes ~1.4x FA3's
time (docs/BENCHMARKS.md). Triton compiles `tl.range(..., warp_specialize=True)` into such a
split on Blackwell; on Hopper, per its changelog, only for a loop without a causal mask whose
loads use descriptors made on the device (`tl.make_tensor_descriptor`). This times the
production kernel's fresh-key path (a copy of `benchmarks/tma_prefill_probe.py`'s probe
kernel, GQA-packed 32 tokens x 4 heads, 128-key tiles) with its unmasked loop so built,
against the same kernel without it, each checked against float32 SDPA first:

    python3 benchmarks/prefill_ws_probe.py --variant NAME     # one variant a process: a
    for v in host device ws ws4 ws-st2; do timeout 60 python3 benchmarks/prefill_ws_probe.py --variant $v; done

(a variant whose compile aborts takes only its own process down). `host`: descriptors made
on the host, as production; `device`: made in the kernel; `ws`: made in the kernel, unmasked
loop warp-specialized; `ws4`: the same with 4 warps; `ws-st2`: with 2 stages.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from kvserve.attention.kernels.common import dot_precision
from kvserve.attention.kernels.prefill import _tile_rows
from kvserve.attention.kernels.prefill_tma import _fold_fresh
from prefill_headroom import HEADS, KV_HEADS, HEAD_DIM, GROUP, LOG2E, RAGGED, fresh_step

DOT_PRECISION = tl.constexpr(dot_precision(torch.bfloat16))

BLOCK_Q, BLOCK_N = 32, 128
BLOCK_M = BLOCK_Q * GROUP
VARIANTS = {"host": dict(DEVICE_DESC=False, WS=False, num_warps=8, num_stages=3),
            "device": dict(DEVICE_DESC=True, WS=False, num_warps=8, num_stages=3),
            "ws": dict(DEVICE_DESC=True, WS=True, num_warps=8, num_stages=3),
            "ws4": dict(DEVICE_DESC=True, WS=True, num_warps=4, num_stages=3),
            "ws-st2": dict(DEVICE_DESC=True, WS=True, num_warps=8, num_stages=2)}


@triton.jit
def _ws_kernel(q_ptr, k_host_desc, v_host_desc, k_ptr, v_ptr, out_ptr, query_start_loc_ptr, qk_scale,
               total_tokens, stride_qt, stride_qh, stride_ot, stride_oh,
               NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEVICE_DESC: tl.constexpr, WS: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    seq = tl.program_id(2)
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    if DEVICE_DESC:
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[total_tokens, KV_HEADS, HEAD_DIM],
                                           strides=[KV_HEADS * HEAD_DIM, HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, 1, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[total_tokens, KV_HEADS, HEAD_DIM],
                                           strides=[KV_HEADS * HEAD_DIM, HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, 1, HEAD_DIM])
    else:
        k_desc, v_desc = k_host_desc, v_host_desc
    kv_head = tl.program_id(1)
    tok, group_head, row_valid = _tile_rows(q_tile, q_len, GROUP, BLOCK_M)
    head = kv_head * GROUP + group_head
    dims = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_valid[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first = q_tile * BLOCK_Q
    diag = first // BLOCK_N * BLOCK_N
    for n in tl.range(0, diag, BLOCK_N, warp_specialize=WS):
        m_i, l_i, acc = _fold_fresh(q, k_desc, v_desc, q_start + n, kv_head, m_i, l_i, acc, qk_scale, tok,
                                    n + tl.arange(0, BLOCK_N), BLOCK_N, HEAD_DIM, False, DOT_PRECISION)
    for n in tl.range(diag, tl.minimum(first + BLOCK_Q, q_len), BLOCK_N):
        m_i, l_i, acc = _fold_fresh(q, k_desc, v_desc, q_start + n, kv_head, m_i, l_i, acc, qk_scale, tok,
                                    n + tl.arange(0, BLOCK_N), BLOCK_N, HEAD_DIM, True, DOT_PRECISION)
    token = (q_start + tok).to(tl.int64)
    out = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (token * stride_ot + head * stride_oh)[:, None] + dims[None, :], out,
             mask=row_valid[:, None])


def launch(q, k, v, out, starts, max_len, DEVICE_DESC, WS, num_warps, num_stages):
    from triton.tools.tensor_descriptor import TensorDescriptor
    kd, vd = (TensorDescriptor.from_tensor(t, [BLOCK_N, 1, HEAD_DIM]) for t in (k, v))
    grid = (triton.cdiv(max_len, BLOCK_Q), KV_HEADS, starts.shape[0] - 1)
    _ws_kernel[grid](q, kd, vd, k, v, out, starts, HEAD_DIM ** -0.5 * LOG2E, k.shape[0],
                     q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                     NUM_HEADS=HEADS, KV_HEADS=KV_HEADS, GROUP=GROUP, HEAD_DIM=HEAD_DIM,
                     BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DEVICE_DESC=DEVICE_DESC, WS=WS,
                     num_warps=num_warps, num_stages=num_stages)
    return out


def case(lengths: list[int], variant: str) -> None:
    q, k, v, starts, ref = fresh_step(lengths)
    total = sum(lengths)
    out = torch.full_like(q, float("nan"))   # poisoned: a row the kernel skips shows in the error
    fn = lambda: launch(q, k, v, out, starts, max(lengths), **VARIANTS[variant])  # noqa: E731
    err = ((fn().float() - ref).norm() / ref.norm()).item()
    ms = do_bench_cudagraph(fn, rep=100)
    flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) // 2 for n in lengths)
    label = f"{len(lengths)} seqs / {total} tokens / max {max(lengths)}"
    print(f"{variant:<8} {label:<32} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s  rel err {err:.1e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=list(VARIANTS), required=True)
    variant = p.parse_args().variant
    # descriptors made on the device need scratch for the descriptor itself
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for lengths in ([1024] * 8, [8192], RAGGED):
        case(lengths, variant)
    for cache in _ws_kernel.device_caches.values():
        for compiled in cache[0].values():
            ttgir = compiled.asm.get("ttgir", "")
            print(f"{variant:<8} regs {compiled.n_regs} spills {compiled.n_spills} "
                  f"warp_specialize ops in TTGIR: {ttgir.count('ttg.warp_specialize')}", flush=True)


if __name__ == "__main__":
    main()
