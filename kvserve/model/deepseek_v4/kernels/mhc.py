"""The mHC (hyper-connection) glue of a V4 block as two Triton kernels:
`hc_pre_norm` (stream weights, Sinkhorn, collapse of the streams and the
block's input RMS norm) and `hc_merge` (the new streams).

Why: the torch path (`layers.hc_pre`, `hc_merge`, `RMSNorm`) launches about
130 small kernels per `hc_pre` with V4-Flash's 20 Sinkhorn iterations; a
batch-1 decode step of V4-Flash-l8 spent 264 of its ~380 launches per layer
there (device profile: 3,409 launches and 6.8 ms per step, launch-bound).
Here each is one launch per call (plus the float32 mixing GEMM, left to
cuBLAS). One program per token; every shape depends on T only (CUDA-graph safe).

Semantics follow the torch path: the mixing weights come from the RMS-normed
streams (applied after the GEMM: the per-token scale commutes with it), the
collapsed input is rounded to the stream dtype before its weighted RMS norm,
as the torch path rounds it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _collapse(row_ptr, pre, hc_rows, d0, dim, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """sum_i pre[i] * streams[i, d0:d0+BLOCK_D] in float32, from the stream dtype rounding point."""
    cols = d0 + tl.arange(0, BLOCK_D)
    mask = (hc_rows < HC)[:, None] & (cols < dim)[None, :]
    tile = tl.load(row_ptr + hc_rows[:, None] * dim + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.sum(pre[:, None] * tile, 0), cols


@triton.jit
def _sinkhorn(logits, ok, eps, iters):
    """Row softmax + eps, then alternating column / row normalisation (padding stays 0)."""
    logits = tl.where(ok, logits, -1e30)
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    comb = tl.where(ok, p / tl.sum(p, 1)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, 0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, 1)[:, None] + eps)
        comb = comb / (tl.sum(comb, 0)[None, :] + eps)
    return comb


@triton.jit
def _hc_pre_kernel(streams_ptr, mixes_ptr, base_ptr, scale_ptr, norm_ptr, post_ptr, comb_ptr, out_ptr, dim,
                   hc_eps, rms_eps, norm_eps, iters, HC: tl.constexpr, HC_PAD: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row_ptr = streams_ptr + t * HC * dim
    i = tl.arange(0, HC_PAD)
    ok = i < HC
    # RMS of the flattened streams: it scales the mixing GEMM's output.
    sq = tl.zeros((BLOCK_D,), tl.float32)
    for d0 in range(0, HC * dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        v = tl.load(row_ptr + cols, mask=cols < HC * dim, other=0.0).to(tl.float32)
        sq += v * v
    inv_rms = tl.rsqrt(tl.sum(sq, 0) / (HC * dim) + rms_eps)
    mix_ptr = mixes_ptr + t * (2 + HC) * HC
    pre = tl.sigmoid(tl.load(mix_ptr + i, mask=ok, other=0.0) * inv_rms * tl.load(scale_ptr)
                     + tl.load(base_ptr + i, mask=ok, other=0.0)) + hc_eps
    pre = tl.where(ok, pre, 0.0)
    post = 2 * tl.sigmoid(tl.load(mix_ptr + HC + i, mask=ok, other=0.0) * inv_rms * tl.load(scale_ptr + 1)
                          + tl.load(base_ptr + HC + i, mask=ok, other=0.0))
    tl.store(post_ptr + t * HC + i, post, mask=ok)
    cell = 2 * HC + i[:, None] * HC + i[None, :]
    ok2 = ok[:, None] & ok[None, :]
    logits = (tl.load(mix_ptr + cell, mask=ok2, other=0.0) * inv_rms * tl.load(scale_ptr + 2)
              + tl.load(base_ptr + cell, mask=ok2, other=0.0))
    comb = _sinkhorn(logits, ok2, hc_eps, iters)
    tl.store(comb_ptr + t * HC * HC + i[:, None] * HC + i[None, :], comb, mask=ok2)
    _collapse_and_norm(row_ptr, pre, i, norm_ptr, out_ptr + t * dim, dim, norm_eps, HC, BLOCK_D)


@triton.jit
def _collapse_and_norm(row_ptr, pre, hc_rows, norm_ptr, out_row, dim, eps, HC: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """out = RMSNorm(collapsed streams rounded to their dtype). Two passes that
    recompute the collapse (no store-then-load of one row across threads)."""
    dtype = out_row.dtype.element_ty
    sq = tl.zeros((BLOCK_D,), tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        x, cols = _collapse(row_ptr, pre, hc_rows, d0, dim, HC, BLOCK_D)
        x = x.to(dtype).to(tl.float32)
        sq += x * x
    inv_rms = tl.rsqrt(tl.sum(sq, 0) / dim + eps)
    for d0 in range(0, dim, BLOCK_D):
        x, cols = _collapse(row_ptr, pre, hc_rows, d0, dim, HC, BLOCK_D)
        w = tl.load(norm_ptr + cols, mask=cols < dim, other=0.0)
        tl.store(out_row + cols, (w * (x.to(dtype).to(tl.float32) * inv_rms)).to(dtype), mask=cols < dim)


def hc_pre_norm(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                norm_weight: torch.Tensor, norm_eps: float, config) -> tuple[torch.Tensor, ...]:
    """`layers.hc_pre` followed by the block's `RMSNorm` of the collapsed input:
    (post [T, hc] float32, comb [T, hc, hc] float32, normed input [T, D])."""
    T, hc, dim = streams.shape
    streams = streams.contiguous()
    mixes = F.linear(streams.view(T, hc * dim).float(), fn.float())
    post = torch.empty(T, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=streams.device)
    out = torch.empty(T, dim, dtype=streams.dtype, device=streams.device)
    if T:
        _hc_pre_kernel[(T,)](streams, mixes, base, scale, norm_weight, post, comb, out, dim, float(config.hc_eps),
                             float(config.rms_norm_eps), float(norm_eps), config.hc_sinkhorn_iters, HC=hc,
                             HC_PAD=triton.next_power_of_2(hc), BLOCK_D=_block(dim), num_warps=4)
    return post, comb, out


@triton.jit
def _hc_merge_kernel(streams_ptr, block_ptr, post_ptr, comb_ptr, out_ptr, dim, HC: tl.constexpr,
                     HC_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, HC_PAD)
    ok = i < HC
    mask = ok[:, None] & (cols < dim)[None, :]
    streams = tl.load(streams_ptr + t * HC * dim + i[:, None] * dim + cols[None, :], mask=mask, other=0.0)
    block = tl.load(block_ptr + t * dim + cols, mask=cols < dim, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * HC + i, mask=ok, other=0.0)
    out_ptr += t * HC * dim
    for j in tl.static_range(HC):
        # comb[i, j]: how much of stream i flows into new stream j
        comb = tl.load(comb_ptr + t * HC * HC + i * HC + j, mask=ok, other=0.0)
        post_j = tl.sum(tl.where(i == j, post, 0.0), 0)
        new = post_j * block + tl.sum(comb[:, None] * streams.to(tl.float32), 0)
        tl.store(out_ptr + j * dim + cols, new.to(out_ptr.dtype.element_ty), mask=cols < dim)


def hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`layers.hc_merge` in one launch (float32 math, one rounding to the stream dtype)."""
    T, hc, dim = streams.shape
    out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    block = _block(dim)
    if T:
        _hc_merge_kernel[(T, triton.cdiv(dim, block))](streams.contiguous(), block_out.contiguous(), post, comb, out,
                                                       dim, HC=hc, HC_PAD=triton.next_power_of_2(hc),
                                                       BLOCK_D=block, num_warps=4)
    return out


def _block(dim: int) -> int:
    return min(1024, triton.next_power_of_2(dim))
