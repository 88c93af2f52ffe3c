"""Fused elementwise ops for the decoder: one Triton kernel each on CUDA, the
plain torch composition (HF's exact numerics) everywhere else.

Unfused, RMSNorm + residual, q/k-norm + RoPE and SiLU-and-mul cost ~40 tiny
kernels per layer: at batch 1 that launch overhead is as large as reading the
weights, and in prefill the fp32 intermediates move gigabytes per step. Each
kernel here reads its inputs once and writes its outputs once, rounding to the
model dtype where HF rounds, so bf16 results track HF's closely and float32
results match it to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: the torch paths below are used.
    triton = None


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


# ---------------------------------------------------------------- RMSNorm (+ residual)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return _rms_norm_triton(x, None, weight, eps)[0]
    return _rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype as HF does."""
    if use_triton(x):
        return _rms_norm_triton(x, residual, weight, eps)
    summed = x + residual
    return _rms_norm_torch(summed, weight, eps), summed


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def _rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else x2
    res = residual.reshape(-1, x.shape[-1]) if residual is not None else x2
    n = x2.shape[1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res, weight, out, res_out, x2.stride(0), res.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n), num_warps=8)
    return out.view(x.shape), res_out.view(x.shape)


if triton is not None:
    import os

    # CUDA's math library (what torch calls) on the GPU; the interpreter has none.
    PRECISE = os.environ.get("TRITON_INTERPRET") != "1"

    @triton.jit
    def _rsqrt(x, PRECISE: tl.constexpr):
        if PRECISE:
            return libdevice.rsqrt(x)
        return 1.0 / tl.sqrt(x)

    @triton.jit
    def _cos_sin(x, PRECISE: tl.constexpr):
        if PRECISE:
            return libdevice.cos(x), libdevice.sin(x)
        return tl.cos(x), tl.sin(x)

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr = PRECISE):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * n + cols, x, mask=mask)
        h = x.to(tl.float32)
        var = tl.sum(h * h, 0) / n
        h = (h * _rsqrt(var + eps, PRECISE)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * n + cols, (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype), mask=mask)


# ---------------------------------------------------------------- SiLU(gate) * up
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    if not use_triton(gate_up):
        gate, up = gate_up.split(half, dim=-1)
        return F.silu(gate) * up
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    out = torch.empty(x2.shape[0], half, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if x2.shape[0]:
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(half, block))](
            x2, out, x2.stride(0), half, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], half)


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < half
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + half + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(out_ptr + row * half + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
                 mask=mask)


# ---------------------------------------------------------------- q/k RMSNorm + RoPE
def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when weights are given) then rotate-half RoPE.

    q: [T, H, D], k: [T, KVH, D], views with a unit last stride. On CUDA they
    are rewritten in place in one launch; elsewhere new tensors are returned.
    """
    if not use_triton(q):
        return _qk_norm_rope_torch(q, k, positions, inv_freq, q_weight, k_weight, eps)
    return _qk_norm_rope_triton(q, k, positions, inv_freq, q_weight, k_weight, eps)


def _qk_norm_rope_triton(q, k, positions, inv_freq, q_weight, k_weight, eps):
    """One program a token, all its heads at once: one program a (token, head) ran
    195 us a layer at an 8K-token step on an H200 (1 warp, 256 bytes each, the angle
    recomputed for every head), ~3% of the step's device time."""
    num_tokens, num_heads, head_dim = q.shape
    q_pow2 = triton.next_power_of_2(num_heads)
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens,)](
            q, k, positions, inv_freq, q_weight if q_weight is not None else inv_freq,
            k_weight if k_weight is not None else inv_freq, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), eps, NUM_Q=num_heads, NUM_K=k.shape[1], Q_POW2=q_pow2,
            K_POW2=triton.next_power_of_2(k.shape[1]), HAS_NORM=q_weight is not None, HALF=head_dim // 2,
            num_warps=4 if q_pow2 * head_dim <= 4096 else 8)
    return q, k


def _qk_norm_rope_torch(q, k, positions, inv_freq, q_weight, k_weight, eps):
    if q_weight is not None:
        q, k = _rms_norm_torch(q, q_weight, eps), _rms_norm_torch(k, k_weight, eps)
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


if triton is not None:
    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh, eps,
                             NUM_Q: tl.constexpr, NUM_K: tl.constexpr, Q_POW2: tl.constexpr,
                             K_POW2: tl.constexpr, HAS_NORM: tl.constexpr, HALF: tl.constexpr,
                             PRECISE: tl.constexpr = PRECISE):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, HALF)
        angle = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + cols)
        cos, sin = _cos_sin(angle, PRECISE)
        _norm_rope_heads(q_ptr + token * stride_qt, stride_qh, qw_ptr, cos, sin, eps,
                         NUM_Q, Q_POW2, HAS_NORM, HALF, PRECISE)
        _norm_rope_heads(k_ptr + token * stride_kt, stride_kh, kw_ptr, cos, sin, eps,
                         NUM_K, K_POW2, HAS_NORM, HALF, PRECISE)

    @triton.jit
    def _norm_rope_heads(base, stride_h, w_ptr, cos, sin, eps, NUM: tl.constexpr, POW2: tl.constexpr,
                         HAS_NORM: tl.constexpr, HALF: tl.constexpr, PRECISE: tl.constexpr):
        """RMSNorm (HAS_NORM) then RoPE of one token's NUM heads, rows of a [POW2, HALF] tile
        per half; each element rounds where HF's composition rounds."""
        cols = tl.arange(0, HALF)
        heads = tl.arange(0, POW2)
        mask = (heads < NUM)[:, None]
        ptrs = base + heads[:, None] * stride_h + cols[None, :]
        x1 = tl.load(ptrs, mask=mask, other=0.0)
        x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
        dtype = x1.dtype
        if HAS_NORM:
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            r = _rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps, PRECISE)[:, None]
            w1 = tl.load(w_ptr + cols).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + cols).to(tl.float32)[None, :]
            x1 = (w1 * (a * r).to(dtype).to(tl.float32)).to(dtype)
            x2 = (w2 * (b * r).to(dtype).to(tl.float32)).to(dtype)
        c = cos.to(dtype).to(tl.float32)[None, :]
        s = sin.to(dtype).to(tl.float32)[None, :]
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(ptrs, (a * c - b * s).to(dtype), mask=mask)
        tl.store(ptrs + HALF, (b * c + a * s).to(dtype), mask=mask)
