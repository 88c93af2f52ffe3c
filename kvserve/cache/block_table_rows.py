"""`BlockTableRows`: every live request's block table, per KV group, as one
row of a numpy array, kept up to date where tables change.

A step's batch tables are then one fancy index per group (a C copy of
B x W int32) instead of flattening Python lists: at 256 requests of 8K
tokens (512 blocks each) the lists cost milliseconds of host time per step,
the rows tens of microseconds. Entries past a row's length are the null
block 0, so a gathered batch is already padded.

Steady decode gathers the same batch step after step: its rows and widths
are remembered (`_Batch`) while no row changes hands and no table grows past
them, so such a gather is a list comparison and one copy per group. A decode
streak that goes on without some rows names the rows it keeps of the last
batch's id list (`gather`'s `previous_rows`): their rows are picked from the
last batch's, with no dict pass over the ids.

Given `max_width` (the most entries a request's table can hold: the engine's
max_model_len in blocks), a batch's width is rounded up to a multiple of
`WIDTH_STEP`, within it. A batch's width then changes once per WIDTH_STEP
blocks its longest table grows, not at each of them. Each new width costs a
new `_Batch`, and on CUDA new views in each of the staging ring's slots
(`StagingRing._lay_out`, ~40-80 us each on the H200's host, eight slots):
exact widths rebuilt a slot's layout every other decode step at 256 running
requests. Null padding costs the kernels nothing (they stop at a row's length),
and the stride Triton sees stays a multiple of 16.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvserve.cache.block_pool import NULL_BLOCK_ID

WIDTH_STEP = 16   # table columns a batch's width is rounded up to (module doc)


class _Batch(NamedTuple):
    """The last gathered batch: its request ids, the rows they had (valid while
    `BlockTableRows._version` stays), per group the batch's width, and the id
    list it was gathered for (the object: a decode streak's `previous_rows` names it)."""
    request_ids: list[str]
    version: int
    rows: np.ndarray
    widths: list[int]
    source: list[str] | None = None


class BlockTableRows:
    def __init__(self, num_groups: int, rows: int = 64, width: int = 16, max_width: int | None = None) -> None:
        self.max_width = max_width   # None: a batch is exactly as wide as its longest table
        width = -(-width // WIDTH_STEP) * WIDTH_STEP
        self._tables = [np.zeros((rows, width), dtype=np.int32) for _ in range(num_groups)]
        self._widths = [width] * num_groups  # the tables' widths: a numpy shape costs a C call
        self._lengths = [np.zeros(rows, dtype=np.int64) for _ in range(num_groups)]
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))
        self._version = 0   # bumped whenever a request takes or releases a row
        self._batch: _Batch | None = None

    def row(self, request_id: str) -> int:
        """The request's row, taken on first use."""
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow_rows()
            row = self._row_of[request_id] = self._free_rows.pop()
            self._version += 1
        return row

    def append(self, request_id: str, group: int, start: int, block_ids: list[int]) -> None:
        """Entries [start, start + len(block_ids)) of the group's table."""
        row, end = self.row(request_id), start + len(block_ids)
        if end > self._widths[group]:
            self._grow_width(group, end)
        self._tables[group][row, start:end] = block_ids
        self._lengths[group][row] = end
        self._widened(group, end)

    def append_one(self, request_id: str, group: int, index: int, block_id: int) -> None:
        """`append(request_id, group, index, [block_id])` (a decode step opening
        a block: an item store, 3x cheaper than a slice)."""
        if index >= self._widths[group]:
            self._grow_width(group, index + 1)
        row = self.row(request_id)
        self._tables[group][row, index] = block_id
        self._lengths[group][row] = index + 1
        self._widened(group, index + 1)

    def append_column(self, request_ids: list[str], group: int, indices: list[int], block_ids: list[int]) -> None:
        """`append_one(request_ids[k], group, indices[k], block_ids[k])` for each k
        (a decode step's rows opening blocks): item stores in one loop, no call a row."""
        top = max(indices) + 1
        if top > self._widths[group]:
            self._grow_width(group, top)
        rows = list(map(self._row_of.get, request_ids))
        if None in rows:   # taking a row may grow the arrays: before they are read below
            rows = list(map(self.row, request_ids))
        table, lengths = self._tables[group], self._lengths[group]
        for row, index, block_id in zip(rows, indices, block_ids):
            table[row, index] = block_id
            lengths[row] = index + 1
        self._widened(group, top)

    def _widened(self, group: int, length: int) -> None:
        """A row of the group is now `length` long: the last batch's width may be too small."""
        if self._batch is not None and length > self._batch.widths[group]:
            self._batch = None

    def set_null(self, request_id: str, group: int, index: int) -> None:
        self._tables[group][self._row_of[request_id], index] = NULL_BLOCK_ID

    def release(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        for table, lengths in zip(self._tables, self._lengths):
            table[row] = NULL_BLOCK_ID   # the whole row: past its length it is null already, and no length is read
            lengths[row] = 0
        self._free_rows.append(row)
        self._version += 1
        batch = self._batch
        if batch is not None and batch.version == self._version - 1 and request_id not in batch.request_ids:
            self._batch = batch._replace(version=self._version)   # not one of its rows: it stands

    def table(self, request_id: str, group: int) -> list[int]:
        """One row as a list (its length's entries; [] for an unknown request).
        Raises RuntimeError if the padding past its length is not the null block."""
        row = self._row_of.get(request_id)
        if row is None:
            return []
        values = self._tables[group][row].tolist()
        length = int(self._lengths[group][row])
        if any(v != NULL_BLOCK_ID for v in values[length:]):
            raise RuntimeError(f"row of {request_id!r} in group {group} has ids past its length {length}")
        return values[:length]

    def gather(self, request_ids: list[str],
               previous_rows: tuple[list[str], np.ndarray] | None = None) -> list[torch.Tensor]:
        """Per group, the requests' tables as one [len(request_ids), W] int32
        tensor (a copy), W the longest of them (at least 1; padded: module doc).
        `previous_rows`: when `request_ids` are rows `kept` of the id list
        `source`, (source, kept) (a decode streak going on without some rows:
        `SchedulerOutput.previous_rows`); the last batch, if gathered for that
        list, gives their rows. Whatever rows changed hands since, those
        requests' did not: they ran all along (the streak vouches)."""
        batch = self._batch
        if batch is None or batch.version != self._version or request_ids != batch.request_ids:
            if batch is not None and previous_rows is not None and previous_rows[0] is batch.source:
                batch = self._batch = self._kept_batch(batch, request_ids, previous_rows[1])
            else:
                batch = self._batch = self._new_batch(request_ids)
        elif batch.source is not request_ids:   # an equal list: the next step's previous_rows name this one
            batch = self._batch = batch._replace(source=request_ids)
        return [torch.from_numpy(table[batch.rows, :width]) for table, width in zip(self._tables, batch.widths)]

    def _new_batch(self, request_ids: list[str]) -> _Batch:
        rows = np.fromiter(map(self._row_of.__getitem__, request_ids), dtype=np.int64, count=len(request_ids))
        return self._batch_of(request_ids, rows)

    def _kept_batch(self, batch: _Batch, request_ids: list[str], kept: np.ndarray) -> _Batch:
        """`batch`'s rows `kept`, the batch of `request_ids`, current (those
        requests held their rows throughout). Padded, it keeps its widths (still
        wide enough): a width that shrank when a long table left would grow back
        as the others do, a new layout each time on CUDA."""
        if self.max_width is None:
            return self._batch_of(request_ids, batch.rows[kept])
        return _Batch(list(request_ids), self._version, batch.rows[kept], batch.widths, request_ids)

    def _batch_of(self, request_ids: list[str], rows: np.ndarray) -> _Batch:
        """The batch of `request_ids` at `rows`, as wide as its longest table needs."""
        widths = [self._padded(max(int(lengths[rows].max(initial=0)), 1)) for lengths in self._lengths]
        return _Batch(list(request_ids), self._version, rows, widths, request_ids)

    def _padded(self, width: int) -> int:
        """A batch's width for its longest table's `width` (module doc)."""
        if self.max_width is None:
            return width
        return max(width, min(-(-width // WIDTH_STEP) * WIDTH_STEP, self.max_width))

    def _grow_rows(self) -> None:
        old = self._tables[0].shape[0]
        self._tables = [np.concatenate([t, np.zeros_like(t)]) for t in self._tables]
        self._lengths = [np.concatenate([n, np.zeros_like(n)]) for n in self._lengths]
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _grow_width(self, group: int, needed: int) -> None:
        """Widen the group's table to hold `needed` entries: a multiple of
        WIDTH_STEP, so a padded batch's columns exist (`_padded`)."""
        table = self._tables[group]
        width = -(-max(needed, 2 * table.shape[1]) // WIDTH_STEP) * WIDTH_STEP
        grown = np.zeros((table.shape[0], width), dtype=np.int32)
        grown[:, :table.shape[1]] = table
        self._tables[group] = grown
        self._widths[group] = width
