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
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens, num_heads + k.shape[1])](
            q, k, positions, inv_freq, q_weight if q_weight is not None else inv_freq,
            k_weight if k_weight is not None else inv_freq, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), num_heads, eps, HAS_NORM=q_weight is not None, HALF=head_dim // 2, num_warps=1)
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
                             stride_qt, stride_qh, stride_kt, stride_kh, num_q_heads, eps,
                             HAS_NORM: tl.constexpr, HALF: tl.constexpr, PRECISE: tl.constexpr = PRECISE):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        is_q = head < num_q_heads
        if is_q:
            base = q_ptr + token * stride_qt + head * stride_qh
            w_ptr = qw_ptr
        else:
            base = k_ptr + token * stride_kt + (head - num_q_heads) * stride_kh
            w_ptr = kw_ptr
        cols = tl.arange(0, HALF)
        x1 = tl.load(base + cols)
        x2 = tl.load(base + HALF + cols)
        dtype = x1.dtype
        if HAS_NORM:
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            r = _rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / (2 * HALF) + eps, PRECISE)
            w1 = tl.load(w_ptr + cols).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + cols).to(tl.float32)
            x1 = (w1 * (a * r).to(dtype).to(tl.float32)).to(dtype)
            x2 = (w2 * (b * r).to(dtype).to(tl.float32)).to(dtype)
        angle = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + cols)
        cos, sin = _cos_sin(angle, PRECISE)
        cos, sin = cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base + cols, (a * cos - b * sin).to(dtype))
        tl.store(base + HALF + cols, (b * cos + a * sin).to(dtype))
