"""How the V4 kernels address the paged KV storage, the per-step batch they
read, and the row scatter that stores a step's new rows (sliding K=V,
compressor state) into their pages.

The storage is one tensor [num_blocks, unit] (cache/v4_specs.py). One layer's
pages of one kind are `rows x width` values at `offset` inside every block;
value (block b, row r, column c) sits at b * unit + offset + r * width + c.
Positions map to rows on the shared token grid: token p lives in table slot
p // B at row p % B; compressed entry w (window [w*rate, (w+1)*rate)) lives in
the slot where its window ends, at row w % rows. Kernels compute these
addresses per key, so any block size works and NULL slots are never read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import triton
import triton.language as tl

from kvserve.cache.v4_specs import V4KVLayout


@dataclass(frozen=True)
class PageRef:
    """One layer's pages of one kind, as the kernels address them."""
    table: torch.Tensor  # [num_seqs, max_blocks] int32 block ids of the page's group
    offset: int          # first value of this layer's page inside a block
    rows: int
    width: int


@dataclass
class V4PagedBatch:
    """Everything the V4 kernels read about one flat batch, built once per
    forward. Tokens are flat: token t belongs to sequence `seq_idx[t]` (-1:
    a padding token, skipped) at `positions[t]`; sequence s's pages of group
    g are `block_tables[g][s]`. `max_seq_len` bounds every position + 1 (it
    sizes the indexer's score rows and plans split-KV: under a CUDA graph,
    the bound of the graph's context bucket, not the step's data). All
    tensors live on the storage's device; nothing here is read back to the
    host. A batch may be static (graphs.py: one per graph, over buffers
    rewritten before each run), so `forward_tokens` empties `scratch` at the
    start of every forward."""
    storage: torch.Tensor
    layout: V4KVLayout
    block_tables: list[torch.Tensor]
    seq_idx: torch.Tensor    # [T] int32
    positions: torch.Tensor  # [T] int64
    max_seq_len: int
    # Per-forward tensors shared by layers (e.g. window-start rope tables), keyed by the user.
    scratch: dict[Any, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def tokens(self, first: int, end: int) -> "V4PagedBatch":
        """The same batch restricted to tokens [first, end) (shared scratch)."""
        return V4PagedBatch(self.storage, self.layout, self.block_tables, self.seq_idx[first:end],
                            self.positions[first:end], self.max_seq_len, self.scratch)

    def page(self, kind: str, layer: int) -> PageRef:
        """`layer`'s pages of `kind` (sliding, csa_state, csa_entries, hca_state, hca_entries)."""
        group_id, g = self.layout.find(kind, layer)
        return PageRef(self.block_tables[group_id], g.slot(layer) * g.kind.layer_page, g.kind.rows,
                       g.kind.width)


# Block size and compress rate are compile-time constants of the kernels: the
# per-key divisions become shifts (runtime divisors cost ~20 instructions and
# registers per key in the attention loop).
@triton.jit
def token_rows(table_row, pos, mask, unit, offset, width, PAGE_SIZE: tl.constexpr):
    """Storage offsets of the rows of tokens at int32 positions `pos` (masked lanes: block 0)."""
    block = tl.load(table_row + pos // PAGE_SIZE, mask=mask, other=0)
    return block.to(tl.int64) * unit + offset + (pos % PAGE_SIZE) * width


@triton.jit
def entry_rows(table_row, entry, mask, unit, offset, width, RATE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Storage offsets of int32 compressed entries `entry` (masked lanes: block 0)."""
    ROWS: tl.constexpr = max(1, PAGE_SIZE // RATE)
    block = tl.load(table_row + ((entry + 1) * RATE - 1) // PAGE_SIZE, mask=mask, other=0)
    return block.to(tl.int64) * unit + offset + (entry % ROWS) * width


# Table widths change from batch to batch: not specialised (no recompiles in a served run).
@triton.jit(do_not_specialize=["stride_table"])
def _write_rows_kernel(src_ptr, stride_src, storage_ptr, unit, offset, table_ptr, stride_table, seq_idx_ptr, pos_ptr,
                       WIDTH: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0)
    seq = tl.load(seq_idx_ptr + t)
    if seq < 0:
        return
    pos = tl.load(pos_ptr + t).to(tl.int32)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row = token_rows(table_ptr + seq.to(tl.int64) * stride_table, pos, True, unit, offset, WIDTH, PAGE_SIZE)
    vals = tl.load(src_ptr + t.to(tl.int64) * stride_src + cols, mask=cols < WIDTH)
    tl.store(storage_ptr + row + cols, vals.to(storage_ptr.dtype.element_ty), mask=cols < WIDTH)


def write_rows(rows: torch.Tensor, page: PageRef, batch: V4PagedBatch) -> None:
    """Store rows [T, page.width] (one per token) at their tokens' page rows."""
    if rows.shape != (batch.num_tokens, page.width) or rows.stride(1) != 1:
        raise ValueError(f"write_rows needs rows of shape ({batch.num_tokens}, {page.width}) with unit "
                         f"column stride, got {tuple(rows.shape)} stride {rows.stride()}")
    if batch.num_tokens == 0:
        return
    block_c = min(1024, page.width & -page.width)  # a power of two dividing the width: no partial tiles
    block_c = block_c if block_c >= 64 else min(1024, triton.next_power_of_2(page.width))
    grid = (batch.num_tokens, triton.cdiv(page.width, block_c))
    _write_rows_kernel[grid](rows, rows.stride(0), batch.storage, batch.storage.stride(0), page.offset,
                             page.table, page.table.stride(0), batch.seq_idx, batch.positions, WIDTH=page.width,
                             PAGE_SIZE=batch.block_size, BLOCK_C=block_c)


@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (4 under the CPU interpreter:
    small enough that tiny test shapes still split)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
