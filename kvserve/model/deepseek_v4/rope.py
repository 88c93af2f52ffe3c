"""V4 rotary embeddings: interleaved RoPE on the trailing `qk_rope_head_dim`
channels of a head, with two settings ("main" for sliding-only layers,
"compress" with optional YaRN for CSA/HCA layers and their compressors)."""
from __future__ import annotations

import math

import torch

from kvserve.model.deepseek_v4.config import DeepseekV4Config, YarnScaling


def inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """One frequency per channel pair (float32), as transformers computes it."""
    # Explicit CPU: modules are built under torch.device("meta"), the tables must be real.
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim
    base = theta ** exponents
    if yarn is None:
        return 1.0 / base
    low, high = _yarn_range(yarn, rope_dim, theta)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (yarn.factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation


def _yarn_range(yarn: YarnScaling, dim: int, theta: float) -> tuple[float, float]:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))
    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    return low, (high + 0.001 if low == high else high)


class V4Rope:
    """cos/sin tables per rope kind, computed per call from positions."""

    def __init__(self, config: DeepseekV4Config) -> None:
        dim = config.qk_rope_head_dim
        self.freqs = {"main": inv_freq(dim, config.rope_theta, None),
                      "compress": inv_freq(dim, config.compress_rope_theta, config.compress_yarn)}

    def cos_sin(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, rope_dim // 2] each, for integer positions [N]."""
        freqs = positions.float()[:, None] * self.freqs[kind].to(positions.device)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing rope channels of x [N, ..., D] (pairs (0,1), (2,3), ...);
    cos/sin are [N, rope_dim // 2] and broadcast over the middle dims."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
