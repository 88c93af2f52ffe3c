"""Batch preparation: scheduled requests -> flat input tensors + attention metadata.

The host side is a few list walks and one `torch.tensor` per array; slot
mappings are derived from the block tables with array ops (no per-token Python
loop), on the host; on CUDA everything then moves to the device in one
non-blocking transfer through reused buffers (`staging.upload_packed`).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.request import PENDING_TOKEN
from kvserve.runner.staging import upload_packed
from kvserve.scheduler import DecodeBatch, ScheduledRequest

@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Row of the hidden states to sample from, one per sampling request.
    logits_indices: torch.Tensor
    sampling_rows: list[ScheduledRequest]
    host: "HostBatch"
    # A decode step's shared-prefix groups and its host block table (KVSERVE_CASCADE=1; the runner's
    # `_plan_cascade`), or None.
    cascade: tuple | None = None
    # Each row's row in the step in flight, on the device, when the step gathers its pending
    # tokens by them (`prepare_inputs`' `kept_rows`), or None.
    kept_rows: torch.Tensor | None = None


@dataclass
class HostBatch:
    """The batch as host tensors, before any device transfer."""
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32
    block_tables: list[torch.Tensor]  # per group [B, W] int32
    seq_idx: torch.Tensor          # [T] sequence of each token
    query_lens: list[int]
    seq_lens_list: list[int]


def build_host_batch(scheduled: list[ScheduledRequest], block_tables: list[torch.Tensor],
                     decode: DecodeBatch | None = None) -> HostBatch:
    """block_tables[g] is the [B, W] int32 table of KV group g, row i request i's
    (padded with the null block; `KVCacheManager.block_tables`, `pad_tables`).
    `decode`: the rows as arrays when each computes its one last token
    (`SchedulerOutput.decode`)."""
    if decode is not None:
        return _decode_host_batch(scheduled, block_tables, decode)
    num_seqs = len(scheduled)
    query_lens = [s.num_new_tokens for s in scheduled]
    starts_np = np.fromiter((s.start_pos for s in scheduled), dtype=np.int64, count=num_seqs)
    q_lens_np = np.array(query_lens, dtype=np.int64)
    if len(query_lens) == int(q_lens_np.sum()):  # decode-only: one token per sequence
        return _decode_host_batch(scheduled, block_tables, DecodeBatch(starts_np, on_device=False))
    seq_lens_np = starts_np + q_lens_np
    tokens = np.array(list(itertools.chain.from_iterable(
        s.request.token_ids_between(s.start_pos, s.start_pos + s.num_new_tokens) for s in scheduled)),
        dtype=np.int64)
    # numpy, not torch: torch's CPU repeat_interleave took 4.4 ms a mixed step in a
    # served H200 run (its thread pool contending with the server's processes).
    ends = np.cumsum(q_lens_np)
    seq_idx_np = np.repeat(np.arange(num_seqs), q_lens_np)
    positions_np = starts_np[seq_idx_np] + np.arange(len(tokens)) - (ends - q_lens_np)[seq_idx_np]
    query_start_loc = torch.from_numpy(np.concatenate(([0], ends)).astype(np.int32))
    seq_idx, positions = torch.from_numpy(seq_idx_np), torch.from_numpy(positions_np)
    return HostBatch(torch.from_numpy(tokens), positions, query_start_loc,
                     torch.from_numpy(seq_lens_np.astype(np.int32)), block_tables, seq_idx, query_lens,
                     seq_lens_np.tolist())


def _decode_host_batch(scheduled: list[ScheduledRequest], block_tables: list[torch.Tensor],
                       decode: DecodeBatch) -> HostBatch:
    """`build_host_batch` of a decode step from its arrays: one token per
    row, PENDING_TOKEN for all of them in the pipelined steady state (each
    row's token is the one its last step sampled, still on the device), else
    looked up per row. Its row-index tensors are shared (`_row_ranges`)."""
    num_seqs, starts = len(scheduled), decode.starts
    if decode.on_device:
        tokens = np.full(num_seqs, PENDING_TOKEN, dtype=np.int64)
    else:
        tokens = np.array(_decode_tokens(scheduled), dtype=np.int64)
    seq_lens = np.add(starts, 1, dtype=np.int32, casting="unsafe")
    ranges = _row_ranges(num_seqs)
    return HostBatch(torch.from_numpy(tokens), torch.from_numpy(starts.copy()), ranges.query_start_loc,
                     torch.from_numpy(seq_lens), block_tables, ranges.rows, [1] * num_seqs, seq_lens.tolist())


class RowRanges(NamedTuple):
    """A decode batch's row-index tensors, which depend on its size alone."""
    query_start_loc: torch.Tensor  # [B + 1] int32: 0..B
    rows: torch.Tensor             # [B] int64: 0..B-1 (each token's sequence, each row's logits row)


_ROW_RANGES: dict[int, RowRanges] = {}
_ALL_ROWS: list[RowRanges] = []   # the widest made: each size's ranges are views of it


def _row_ranges(num_seqs: int) -> RowRanges:
    """`RowRanges` of `num_seqs` rows, made once per size and shared by every
    decode batch of that size: read-only (consumers copy or read them). A
    torch.arange was the costliest op of a decode step's input preparation,
    ~100 us on this project's CPU with the caches cold after sampling; a new
    size (a server's running set changes size on most steps) takes views of
    the widest ranges made, doubled when too few."""
    ranges = _ROW_RANGES.get(num_seqs)
    if ranges is None:
        if not _ALL_ROWS or len(_ALL_ROWS[0].rows) < num_seqs:
            n = max(num_seqs, 2 * len(_ALL_ROWS[0].rows) if _ALL_ROWS else 256)
            _ALL_ROWS[:] = [RowRanges(torch.arange(n + 1, dtype=torch.int32), torch.arange(n))]
        widest = _ALL_ROWS[0]
        ranges = _ROW_RANGES[num_seqs] = RowRanges(widest.query_start_loc[:num_seqs + 1], widest.rows[:num_seqs])
    return ranges


def _decode_tokens(scheduled: list[ScheduledRequest]) -> list[int]:
    """Each decode row's one token: a prompt or output token, or PENDING_TOKEN
    while it is still on the device (the pipelined steady state). One loop
    with the lookups inlined: it runs once per running request per step."""
    tokens = []
    append = tokens.append
    for s in scheduled:
        request, pos = s.request, s.start_pos
        prompt = request.prompt_token_ids
        if pos < len(prompt):
            append(prompt[pos])
            continue
        pos -= len(prompt)
        out = request.output_token_ids
        append(out[pos] if pos < len(out) else PENDING_TOKEN)
    return tokens


def prepare_inputs(scheduled: list[ScheduledRequest], block_tables: list[torch.Tensor],
                   block_size: int, device: torch.device, decode: DecodeBatch | None = None,
                   kept_rows: np.ndarray | None = None) -> ModelInputs:
    host = build_host_batch(scheduled, block_tables, decode)
    return to_model_inputs(host, scheduled, block_size, device, decode, kept_rows)


def to_model_inputs(host: HostBatch, scheduled: list[ScheduledRequest], block_size: int,
                    device: torch.device, decode: DecodeBatch | None = None,
                    kept_rows: np.ndarray | None = None) -> ModelInputs:
    """`decode` (`SchedulerOutput.decode`) says every row samples; `kept_rows` (a
    decode step's) travels with the step's upload, as `ModelInputs.kept_rows`."""
    if decode is not None:  # each row's one token is its logits row
        return inputs_for_rows(host, range(len(scheduled)), list(scheduled), block_size, device,
                               _row_ranges(len(scheduled)).rows, kept_rows)
    rows = _completing_rows(scheduled, host.seq_lens_list)
    return inputs_for_rows(host, rows, [scheduled[i] for i in rows], block_size, device)


def _completing_rows(scheduled: list[ScheduledRequest], seq_lens: list[int]) -> list[int]:
    """Rows that sample: `completes_sequence`, with the batch's seq lens (start
    + new tokens) and the request's token count inlined (hot: every row, every step)."""
    return [i for i, (s, end) in enumerate(zip(scheduled, seq_lens))
            if end == len((r := s.request).prompt_token_ids) + len(r.output_token_ids) + r.num_pending_tokens]


def inputs_for_rows(host: HostBatch, rows: Sequence[int], sampling_rows: list[ScheduledRequest],
                    block_size: int, device: torch.device,
                    logits_indices: torch.Tensor | None = None,
                    kept_rows: np.ndarray | None = None) -> ModelInputs:
    """Device inputs whose logits rows are those of sequences `rows` (a
    tensor-parallel worker, which samples nothing, passes none), at
    `logits_indices` when the caller knows them. One transfer in all
    (`upload_packed`), `kept_rows` with it; slot mappings are computed here."""
    if logits_indices is None:
        last = host.query_start_loc[1:].long() - 1
        logits_indices = last if len(rows) == len(host.query_lens) else last[rows]
    slots = [slot_mapping(t, host.seq_idx, host.positions, block_size) for t in host.block_tables]
    groups = len(slots)
    extra = [] if kept_rows is None else [torch.from_numpy(kept_rows)]
    input_ids, positions, logits_indices, query_start_loc, seq_lens, *rest = upload_packed(
        [host.input_ids, host.positions, logits_indices, host.query_start_loc, host.seq_lens, *slots,
         *host.block_tables, *extra], device)
    slots, tables, kept = rest[:groups], rest[groups:2 * groups], rest[2 * groups:]
    meta = AttentionMetadata(
        num_seqs=len(host.seq_lens_list), num_tokens=len(host.input_ids), block_size=block_size,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=tables, slot_mappings=slots,
        max_query_len=max(host.query_lens), max_seq_len=max(host.seq_lens_list),
        query_lens_cpu=host.query_lens, seq_lens_cpu=host.seq_lens_list)
    return ModelInputs(input_ids=input_ids, positions=positions, meta=meta,
                       logits_indices=logits_indices, sampling_rows=sampling_rows, host=host,
                       kept_rows=kept[0] if kept else None)


def slot_mapping(table: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Flat cache slot of each token (host tensors): its block's id * block_size
    + offset. In numpy: half the time of the same torch ops on a small batch;
    fused ops (divmod, a multiply into int64): each numpy call of a step costs
    ~10-40 us on this project's CPU with the caches cold after sampling."""
    index, offset = np.divmod(positions.numpy(), block_size)
    slots = np.multiply(table.numpy()[seq_idx.numpy(), index], block_size, dtype=np.int64)
    slots += offset
    return torch.from_numpy(slots)


def pad_tables(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    """Rows padded with the null block 0 to a common width (tables built
    outside the KV cache manager: the memory profile, tests). One numpy pass
    over the ids: `torch.tensor` of a Python list costs ~0.6 us per element,
    15 ms for 256 sequences of 1K tokens."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = max(int(lengths.max(initial=0)), 1) if width is None else width
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width) < lengths[:, None]] = flat
    return torch.from_numpy(out)
