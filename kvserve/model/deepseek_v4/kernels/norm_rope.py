"""RMS norm and interleaved RoPE of V4 attention rows, as one Triton kernel:
`rms_norm` (q LoRA norm), `norm_rope` (queries: unweighted per-head norm then
rope; K=V: weighted norm then rope; attention output and indexer queries:
rope alone, the output's inverted).

Why: in torch a weighted RMS norm is ~8 launches, the unweighted one ~7 and
`rope.apply_rope` ~10; a V4-Flash-l8 batch-1 decode step spent ~67 of its
~380 launches per layer on them. Here each is one launch, one program per
row (token x head), every shape fixed by the input's (CUDA-graph safe).

Rounding follows the torch path (`layers.RMSNorm`, `layers.unweighted_rms_norm`,
`rope.apply_rope`): the normed row is rounded to the input dtype before the
rotation, which runs in float32 on the dtype's cos/sin tables.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_NORM, UNWEIGHTED, WEIGHTED = 0, 1, 2


@triton.jit
def _normed(x, w_ptr, cols, mask, eps, dtype: tl.constexpr, DIM: tl.constexpr, NORM: tl.constexpr):
    """Row x (float32, zero past DIM) normed as the torch path norms it, rounded to dtype."""
    if NORM == 1:  # x * rsqrt(mean(x^2) + eps).to(dtype): the scale is rounded first
        scale = tl.rsqrt(tl.sum(x * x, 0) / DIM + eps).to(dtype).to(tl.float32)
        x = x * scale
    elif NORM == 2:
        x = tl.load(w_ptr + cols, mask=mask, other=0.0) * (x * tl.rsqrt(tl.sum(x * x, 0) / DIM + eps))
    return x.to(dtype).to(tl.float32)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, eps, sin_sign, DIM: tl.constexpr,
                      HALF_ROPE: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    mask = cols < DIM
    x = _normed(tl.load(x_ptr + row * DIM + cols, mask=mask, other=0.0).to(tl.float32), w_ptr, cols, mask, eps,
                dtype, DIM, NORM)
    if HALF_ROPE > 0:
        even, odd = tl.split(tl.reshape(x, (BLOCK_D // 2, 2)))
        pair = tl.arange(0, BLOCK_D // 2)
        rope_pair = pair - (DIM // 2 - HALF_ROPE)
        in_rope = (rope_pair >= 0) & (pair < DIM // 2)
        table = (row // heads) * HALF_ROPE + rope_pair
        cos = tl.load(cos_ptr + table, mask=in_rope, other=1.0).to(tl.float32)
        sin = sin_sign * tl.load(sin_ptr + table, mask=in_rope, other=0.0).to(tl.float32)
        x = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BLOCK_D,))
    tl.store(out_ptr + row * DIM + cols, x.to(dtype), mask=mask)


def norm_rope(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, norm: int = NO_NORM,
              weight: torch.Tensor | None = None, eps: float = 0.0, inverse: bool = False) -> torch.Tensor:
    """x [N, D] or [N, heads, D] normed (`norm`: NO_NORM, UNWEIGHTED, or WEIGHTED
    by `weight` [D]) and, with cos/sin [N, rope_dim // 2], its trailing rope
    channels rotated (back, with `inverse`). A new tensor of x's shape and dtype."""
    N, D = x.shape[0], x.shape[-1]
    heads = x[0].numel() // D if N else 1
    x = x.contiguous()
    out = torch.empty_like(x)
    half = cos.shape[-1] if cos is not None else 0
    if x.numel():
        _norm_rope_kernel[(N * heads,)](x, weight if weight is not None else x, cos if half else x,
                                        sin if half else x, out, heads, float(eps), -1.0 if inverse else 1.0,
                                        DIM=D, HALF_ROPE=half, NORM=norm, BLOCK_D=triton.next_power_of_2(D),
                                        num_warps=4 if D <= 1024 else 8)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.RMSNorm` of the rows of x [N, D] in one launch."""
    return norm_rope(x, None, None, WEIGHTED, weight, eps)
