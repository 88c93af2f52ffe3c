"""V4 compressor kernel: every token that closes a window pools it into one
entry (softmax over the window's positions of gate + position bias, per
channel), RMS-norms and RoPEs it, and stores it in the compressed-entry page.

The window's raw (kv, gate) rows are read from the compressor-state pages,
which must already hold this step's rows (`write_rows` first). CSA pools the
overlapping 2 x rate rows: the previous window's first `dim` channels next to
this window's last `dim` channels (no previous window for entry 0); HCA pools
`rate` rows of `dim` channels. Semantics and rounding points follow
`kvserve.attention.v4_torch_ref.pool_windows` and `Compressor.new_entries`:
pooled, normed and roped values are rounded to the cache dtype where the
torch path rounds them, the softmax runs in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.model.deepseek_v4.kernels.pages import PageRef, V4PagedBatch, entry_rows, token_rows


@triton.jit
def _pool_rows(m, l, acc, storage_ptr, unit, state_offset, state_width, state_row_ptr, first, kv_col, gate_col,
               ape_ptr, ape_stride, ape_col, cols, col_mask, RATE: tl.constexpr, PAGE_SIZE: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """Fold positions first..first+RATE-1 (channels at kv_col / gate_col) into
    the per-channel online softmax (max m, sum l, weighted sum acc)."""
    for r0 in range(0, RATE, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        row_mask = r < RATE
        rows = token_rows(state_row_ptr, first + r, row_mask, unit, state_offset, state_width, PAGE_SIZE)
        mask = row_mask[:, None] & col_mask[None, :]
        kv = tl.load(storage_ptr + rows[:, None] + kv_col + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(storage_ptr + rows[:, None] + gate_col + cols[None, :], mask=mask, other=0.0)
        bias = tl.load(ape_ptr + r[:, None] * ape_stride + ape_col + cols[None, :], mask=mask, other=0.0)
        gate = tl.where(row_mask[:, None], gate.to(tl.float32) + bias, float("-inf"))
        m_new = tl.maximum(m, tl.max(gate, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(gate - m_new[None, :])
        l = l * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p * kv, 0)
        m = m_new
    return m, l, acc


@triton.jit
def _norm_and_rope(pooled, norm_ptr, cos_row, sin_row, cols, col_mask, eps, dtype: tl.constexpr,
                   DIM: tl.constexpr, HALF_ROPE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Weighted RMS norm of `pooled` (rounded to the cache dtype first, as the
    torch path norms the pooled entry), then the interleaved rotation of the
    trailing 2 * HALF_ROPE channels."""
    x = tl.where(col_mask, pooled.to(dtype).to(tl.float32), 0.0)
    x = x * tl.rsqrt(tl.sum(x * x, 0) / DIM + eps)
    x = (tl.load(norm_ptr + cols, mask=col_mask, other=0.0) * x).to(dtype).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (BLOCK_D // 2, 2)))
    pair = tl.arange(0, BLOCK_D // 2)
    rope_pair = pair - (DIM // 2 - HALF_ROPE)
    in_rope = (rope_pair >= 0) & (pair < DIM // 2)
    cos = tl.load(cos_row + rope_pair, mask=in_rope, other=1.0).to(tl.float32)
    sin = tl.load(sin_row + rope_pair, mask=in_rope, other=0.0).to(tl.float32)
    return tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BLOCK_D,))


@triton.jit(do_not_specialize=["state_stride_table", "entry_stride_table"])
def _compress_kernel(storage_ptr, unit, state_offset, state_width, state_table, state_stride_table,
                     entry_offset, entry_width, entry_table, entry_stride_table,
                     kv_col, gate_col, out_col, ape_ptr, norm_ptr, cos_ptr, sin_ptr, stride_rope,
                     seq_idx_ptr, pos_ptr, eps, RATE: tl.constexpr, PAGE_SIZE: tl.constexpr, DIM: tl.constexpr,
                     OVERLAP: tl.constexpr, HALF_ROPE: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    seq = tl.load(seq_idx_ptr + t)
    pos = tl.load(pos_ptr + t).to(tl.int32)
    if (seq < 0) | ((pos + 1) % RATE != 0):
        return  # this token closes no window
    w = (pos + 1) // RATE - 1
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < DIM  # all true for power-of-two dims: the loads stay vectorised
    state_row_ptr = state_table + seq.to(tl.int64) * state_stride_table
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    if OVERLAP:
        ape_stride = 2 * DIM
        current = DIM  # this window's channels are the second half
        if w > 0:
            m, l, acc = _pool_rows(m, l, acc, storage_ptr, unit, state_offset, state_width, state_row_ptr,
                                   (w - 1) * RATE, kv_col, gate_col, ape_ptr, ape_stride, 0, cols, col_mask,
                                   RATE, PAGE_SIZE, BLOCK_R)
    else:
        ape_stride = DIM
        current = 0
    m, l, acc = _pool_rows(m, l, acc, storage_ptr, unit, state_offset, state_width, state_row_ptr, w * RATE,
                           kv_col + current, gate_col + current, ape_ptr, ape_stride, current, cols, col_mask,
                           RATE, PAGE_SIZE, BLOCK_R)
    dtype = storage_ptr.dtype.element_ty
    entry = _norm_and_rope(acc / l, norm_ptr, cos_ptr + t.to(tl.int64) * stride_rope,
                           sin_ptr + t.to(tl.int64) * stride_rope, cols, col_mask, eps, dtype, DIM,
                           HALF_ROPE, BLOCK_D)
    entry_row_ptr = entry_table + seq.to(tl.int64) * entry_stride_table
    row = entry_rows(entry_row_ptr, w, True, unit, entry_offset, entry_width, RATE, PAGE_SIZE)
    tl.store(storage_ptr + row + out_col + cols, entry.to(dtype), mask=col_mask)


def compress(state: PageRef, entries: PageRef, batch: V4PagedBatch, columns: tuple[int, int, int],
             rate: int, overlap: bool, ape: torch.Tensor, norm_weight: torch.Tensor, eps: float,
             cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Pool, norm, rope and store the entry of every window a token of the batch closes.

    columns = (kv, gate, out): where this compressor's kv and gate start in a
    state row and where its entry starts in an entry row. ape [rate, C] and
    norm_weight [dim] are float32; cos/sin [T, rope_dim // 2] hold the rope
    of each token's window start ((p + 1) // rate - 1) * rate.
    """
    dim = norm_weight.shape[0]
    if ape.shape != (rate, (2 if overlap else 1) * dim):
        raise ValueError(f"compressor position bias must be ({rate}, {(2 if overlap else 1) * dim}), "
                         f"got {tuple(ape.shape)}")
    if batch.num_tokens == 0:
        return
    kv_col, gate_col, out_col = columns
    block_d = max(2, triton.next_power_of_2(dim))
    # Rows per tile: big enough to stream, small enough that kv + gate tiles stay in registers.
    block_r = max(1, min(triton.next_power_of_2(rate), 4096 // block_d))
    _compress_kernel[(batch.num_tokens,)](
        batch.storage, batch.storage.stride(0), state.offset, state.width, state.table, state.table.stride(0),
        entries.offset, entries.width, entries.table, entries.table.stride(0),
        kv_col, gate_col, out_col, ape, norm_weight, cos, sin, cos.stride(0), batch.seq_idx, batch.positions,
        eps, RATE=rate, PAGE_SIZE=batch.block_size, DIM=dim, OVERLAP=overlap, HALF_ROPE=cos.shape[1],
        BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4)
