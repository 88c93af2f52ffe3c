"""The routed experts of the DeepSeek V4 MoE as two grouped GEMMs over the
stacked expert weights (w1, w3: [E, I, H]; w2: [E, H, I]), with no host
synchronisation: every shape and launch grid depends on T, k and E only, so
a forward can be captured in a CUDA graph.

`route` (one launch) groups the T*k (token, slot) pairs by expert, in pair
order, in tiles of BLOCK_M rows, each expert's rows starting on a tile
boundary (padding rows hold pair -1). Each expert with rows adds at most one
partly filled tile, so T*k // BLOCK_M + min(E, T*k) tiles always suffice;
tiles past the last expert's rows exit at once. `_gate_up_kernel` multiplies
each tile's gathered token rows by its expert's w1 and w3 and applies the
clamped SwiGLU (intermediate [tiles * BLOCK_M, I]); `_down_kernel` multiplies
by w2 and the routing weight into one float32 row per pair, and torch sums
each token's k rows: the same bits on every run, unlike atomic adds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of both GEMMs: `block_n` tiles the output columns (I for
    gate/up, H for down), `block_k` the reduction (H, then I)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16 (tl.dot), got {size}")


def tile_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> TileConfig:
    """Rows per tile near the mean rows per expert: decode batches spread a few
    rows over many experts (16-row tiles, wide K steps: weight-bandwidth bound),
    long prefills fill 64-row tiles (compute bound). float32 halves the K step
    so three pipeline stages of x, w1 and w3 tiles stay within shared memory."""
    mean_rows = -(-num_pairs // num_experts)
    if mean_rows <= 16:
        m, n, k, warps = 16, 64, 128, 4
    elif mean_rows <= 32:
        m, n, k, warps = 32, 64, 128, 4
    else:
        m, n, k, warps = 64, 128, 64, 8
    return TileConfig(m, n, k // 2 if dtype.itemsize == 4 else k, num_warps=warps, num_stages=3)


@dataclass(frozen=True)
class ExpertTiles:
    """The (token, slot) pairs grouped by expert in tiles of `block_m` rows."""
    pair: torch.Tensor    # [num_tiles * block_m] int32: token * k + slot of each row; -1: padding
    expert: torch.Tensor  # [num_tiles] int32: each tile's expert; num_experts: an unused tile
    block_m: int

    @property
    def num_tiles(self) -> int:
        return self.expert.shape[0]


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    return num_pairs // block_m + min(num_experts, num_pairs)


def moe_build(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple:
    """What `route` and the two GEMMs are built for at `num_pairs` (token, slot) pairs: the tile
    config, the route's pair block, and how Triton specialises the pair and tile counts (1, a
    multiple of 16, other). Equal for two pair counts: no new build (`kernels/warmup.py`)."""
    config = tile_config(num_pairs, num_experts, dtype)
    tiles = max_tiles(num_pairs, num_experts, config.block_m)
    return config, _pair_block(num_pairs), *(1 if n == 1 else 16 if n % 16 == 0 else 0 for n in (num_pairs, tiles))


def _pair_block(num_pairs: int) -> int:
    return min(4096, triton.next_power_of_2(num_pairs))


def route(indices: torch.Tensor, num_experts: int, block_m: int) -> ExpertTiles:
    """Tiles of the pairs of `indices` [T, k] (expert ids), in one launch. Rows
    of the unused tiles are left unwritten: the GEMMs never read them."""
    num_pairs = indices.numel()
    num_tiles = max_tiles(num_pairs, num_experts, block_m)
    pair = torch.empty(num_tiles * block_m, dtype=torch.int32, device=indices.device)
    expert = torch.empty(num_tiles, dtype=torch.int32, device=indices.device)
    _route_kernel[(num_experts + 1,)](indices.contiguous(), pair, expert, num_pairs, num_tiles, num_experts,
                                      BLOCK_M=block_m, BLOCK_P=_pair_block(num_pairs),
                                      BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4)
    return ExpertTiles(pair, expert, block_m)


# Program e < E places expert e's pairs, in pair order (stable); program E marks
# the unused tiles. Each counts every expert's pairs itself (a histogram of the
# T*k ids, read from L2): no second launch to share the counts.
@triton.jit
def _route_kernel(experts_ptr, pair_ptr, tile_expert_ptr, num_pairs, num_tiles, num_experts,
                  BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_P)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        ids = tl.load(experts_ptr + p0 + lanes, mask=p0 + lanes < num_pairs, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=p0 + lanes < num_pairs)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    bins = tl.arange(0, BLOCK_E)
    start = tl.sum(tl.where(bins < e, padded, 0))
    if e == num_experts:
        _fill_tiles(tile_expert_ptr, start // BLOCK_M, num_tiles, num_experts)
        return
    rank0 = 0
    for p0 in range(0, num_pairs, BLOCK_P):
        ids = tl.load(experts_ptr + p0 + lanes, mask=p0 + lanes < num_pairs, other=-1)
        hit = (ids == e).to(tl.int32)
        tl.store(pair_ptr + start + rank0 + tl.cumsum(hit, 0) - 1, p0 + lanes, mask=hit != 0)
        rank0 += tl.sum(hit)
    rows = rank0 + tl.arange(0, BLOCK_M)
    end = start + tl.sum(tl.where(bins == e, padded, 0))
    tl.store(pair_ptr + start + rows, -1, mask=start + rows < end)
    _fill_tiles(tile_expert_ptr, start // BLOCK_M, end // BLOCK_M, e)


@triton.jit
def _fill_tiles(tile_expert_ptr, first, end, value):
    for t0 in range(first, end, 64):
        tiles = t0 + tl.arange(0, 64)
        tl.store(tile_expert_ptr + tiles, tl.full((64,), 0, tl.int32) + value, mask=tiles < end)


@triton.jit
def _gate_up_kernel(x_ptr, stride_x, w1_ptr, w3_ptr, stride_we, stride_wn, pair_ptr, expert_ptr, inter_ptr,
                    stride_inter, hidden, inter_size, num_experts, limit, TOP_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(expert_ptr + tile)
    if expert >= num_experts:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    valid = pair >= 0
    token = tl.where(valid, pair // TOP_K, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token.to(tl.int64)[:, None] * stride_x
    w_cols = expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        a = tl.load(x_rows + k[None, :], mask=valid[:, None] & (k < hidden)[None, :], other=0.0)
        w_mask = (k < hidden)[:, None] & (cols < inter_size)[None, :]
        gate = tl.dot(a, tl.load(w1_ptr + w_cols + k[:, None], mask=w_mask, other=0.0), gate,
                      input_precision=DOT_PRECISION)
        up = tl.dot(a, tl.load(w3_ptr + w_cols + k[:, None], mask=w_mask, other=0.0), up,
                    input_precision=DOT_PRECISION)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    # Padding rows are written too (zeros): the down kernel reads whole tiles.
    tl.store(inter_ptr + rows.to(tl.int64)[:, None] * stride_inter + cols[None, :],
             h.to(inter_ptr.dtype.element_ty), mask=(cols < inter_size)[None, :])


@triton.jit
def _down_kernel(inter_ptr, stride_inter, w2_ptr, stride_we, stride_wn, pair_ptr, expert_ptr, route_weight_ptr,
                 out_ptr, stride_out, hidden, inter_size, num_experts, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(expert_ptr + tile)
    if expert >= num_experts:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    valid = pair >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_rows = inter_ptr + rows.to(tl.int64)[:, None] * stride_inter
    w_cols = expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_rows + k[None, :], mask=(k < inter_size)[None, :], other=0.0)
        w = tl.load(w2_ptr + w_cols + k[:, None], mask=(k < inter_size)[:, None] & (cols < hidden)[None, :],
                    other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    safe_pair = tl.where(valid, pair, 0).to(tl.int64)
    weight = tl.load(route_weight_ptr + safe_pair, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + safe_pair[:, None] * stride_out + cols[None, :], acc * weight[:, None],
             mask=valid[:, None] & (cols < hidden)[None, :])


def fused_moe(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              indices: torch.Tensor, limit: float, config: TileConfig | None = None,
              empty: Callable[..., torch.Tensor] = torch.empty) -> torch.Tensor:
    """Routed experts' output [T, H] in x.dtype: for each token t, the sum over
    its slots j of weights[t, j] * w2[e] @ silu(min(w1[e] x_t, limit)) *
    clamp(w3[e] x_t, -limit, limit), e = indices[t, j]. Accumulates in float32.
    `empty` allocates the scratch buffers (tests poison them)."""
    _check_inputs(x, w1, w3, w2, weights, indices)
    num_tokens, top_k = indices.shape
    num_experts, inter_size, hidden = w1.shape
    if num_tokens == 0:
        return x.new_zeros(x.shape)
    config = config or tile_config(num_tokens * top_k, num_experts, x.dtype)
    tiles = route(indices, num_experts, config.block_m)
    inter = empty((tiles.num_tiles * config.block_m, inter_size), dtype=x.dtype, device=x.device)
    slots = empty((num_tokens * top_k, hidden), dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models are the exact reference runs
    block_n, block_k = _fit(config.block_n, inter_size), _fit(config.block_k, hidden)
    _gate_up_kernel[(tiles.num_tiles, triton.cdiv(inter_size, block_n))](
        x, x.stride(0), w1, w3, w1.stride(0), w1.stride(1), tiles.pair, tiles.expert, inter, inter.stride(0),
        hidden, inter_size, num_experts, float(limit), TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages)
    block_n, block_k = _fit(config.block_n, hidden), _fit(config.block_k, inter_size)
    _down_kernel[(tiles.num_tiles, triton.cdiv(hidden, block_n))](
        inter, inter.stride(0), w2, w2.stride(0), w2.stride(1), tiles.pair, tiles.expert, weights.contiguous(),
        slots, slots.stride(0), hidden, inter_size, num_experts, BLOCK_M=config.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages)
    return slots.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _fit(block: int, dim: int) -> int:
    """A block no wider than the dimension needs (tiny test models)."""
    return min(block, max(16, triton.next_power_of_2(dim)))


def _check_inputs(x, w1, w3, w2, weights, indices) -> None:
    num_experts, inter_size, hidden = w1.shape
    if w3.shape != w1.shape or w2.shape != (num_experts, hidden, inter_size):
        raise ValueError(f"fused_moe needs w1, w3 [E, I, H] and w2 [E, H, I], got {tuple(w1.shape)}, "
                         f"{tuple(w3.shape)}, {tuple(w2.shape)}")
    if x.dim() != 2 or x.shape[1] != hidden or indices.shape != weights.shape or indices.shape[:1] != x.shape[:1]:
        raise ValueError(f"fused_moe needs x [T, {hidden}] and weights, indices [T, k], got {tuple(x.shape)}, "
                         f"{tuple(weights.shape)}, {tuple(indices.shape)}")
    if any(t.dtype != x.dtype for t in (w1, w3, w2)):
        raise ValueError(f"fused_moe needs x and the expert weights in one dtype, got {x.dtype}, {w1.dtype}, "
                         f"{w3.dtype}, {w2.dtype}")
    if x.stride(1) != 1 or not all(t.is_contiguous() for t in (w1, w3, w2)):
        raise ValueError("fused_moe needs x with unit column stride and contiguous expert weights")
