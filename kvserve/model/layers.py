"""Building blocks shared by the Llama family: RMSNorm, rotary embedding
(default and llama3 scaling) and the gated SiLU MLP.

Numerics mirror HF transformers so parity tests can use tight tolerances:
RMSNorm and the rotary angles are computed in float32 whatever the model dtype.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.model.config import Llama3RopeScaling
from kvserve.model.fused_ops import add_rms_norm, rms_norm, silu_and_mul


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: Llama3RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, as HF computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Owns RoPE's inverse frequencies. Angles are computed per step from
    positions (no table), so any position up to the model's limit works; the
    rotation itself is `fused_ops.qk_norm_rope_`."""

    def __init__(self, head_dim: int, theta: float,
                 scaling: Llama3RopeScaling | None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling),
                             persistent=False)

    def reset_parameters(self) -> None:
        """Recompute inv_freq in place (after `to_empty` left it uninitialised)."""
        self.inv_freq.copy_(rope_inv_freq(self.head_dim, self.theta, self.scaling))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 down_proj: nn.Module | None = None) -> None:
        """`down_proj` replaces the plain linear (a row-parallel one under tensor parallelism)."""
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = down_proj if down_proj is not None else nn.Linear(
            intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
