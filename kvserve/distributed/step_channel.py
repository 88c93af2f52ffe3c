"""The driver's steps and logits calls, sent to the worker ranks without pickling.

Per step the driver broadcasts over the host group a fixed header

    [OP_STEP, payload length, tokens T, sequences B, KV groups G]

then one flat int64 payload: the G block-table widths, input ids [T]
(tokens sampled by the step in flight are still `PENDING_TOKEN`), positions
[T], query_start_loc [B + 1], seq_lens [B], seq_idx [T] and each group's block
table [B, W_g]. When some input ids are pending, the driver then broadcasts
its device input ids (after filling them from its sampled ids) over the
device group, so the workers' forward reads the same tokens. A worker
rebuilds the step's `ModelInputs` with the runner's own `inputs_for_rows`,
so both sides see the same metadata and take the same graph-or-eager path.

Every logits computation on the driver (sampling rows, prompt-logprob
passes, whatever asks) is announced as [OP_LOGITS, rows R] followed by a
device broadcast of its [R, hidden] states: the workers compute their vocab
shard of the same rows and join the gather, so no caller needs to know.
"""
from __future__ import annotations

import torch

from kvserve.distributed.group import TPGroup
from kvserve.request import PENDING_TOKEN
from kvserve.runner.batch import HostBatch, ModelInputs, inputs_for_rows

OP_STOP, OP_STEP, OP_LOGITS = 0, 1, 2
HEADER_LEN = 5


def pack(host: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of one step."""
    widths = torch.tensor([t.shape[1] for t in host.block_tables], dtype=torch.int64)
    parts = [widths, host.input_ids, host.positions, host.query_start_loc, host.seq_lens, host.seq_idx,
             *host.block_tables]
    payload = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
    return _header(OP_STEP, len(payload), len(host.input_ids), len(host.seq_lens), len(host.block_tables)), payload


def unpack(header: torch.Tensor, payload: torch.Tensor) -> HostBatch:
    """The step's host batch, as the driver built it."""
    _, _, num_tokens, num_seqs, num_groups = header.tolist()
    widths = payload[:num_groups].tolist()
    sizes = [num_tokens, num_tokens, num_seqs + 1, num_seqs, num_tokens, *(num_seqs * w for w in widths)]
    input_ids, positions, qsl, seq_lens, seq_idx, *tables = payload[num_groups:].split(sizes)
    tables = [t.view(num_seqs, w).to(torch.int32) for t, w in zip(tables, widths)]
    query_start_loc, seq_lens = qsl.to(torch.int32), seq_lens.to(torch.int32)
    return HostBatch(input_ids, positions, query_start_loc, seq_lens, tables, seq_idx,
                     query_start_loc.diff().tolist(), seq_lens.tolist())


def has_pending(host: HostBatch) -> bool:
    return bool((host.input_ids == PENDING_TOKEN).any())


def _header(*values: int) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return header


class StepPublisher:
    """Driver side: `publish` per launched step, `announce_logits` per logits
    computation, `stop` once at shutdown."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def publish(self, inputs: ModelInputs) -> None:
        header, payload = pack(inputs.host)
        self.group.host_broadcast(header)
        self.group.host_broadcast(payload)
        if has_pending(inputs.host):
            self.group.broadcast(inputs.input_ids)  # already filled from the sampled ids

    def announce_logits(self, hidden: torch.Tensor) -> None:
        self.group.host_broadcast(_header(OP_LOGITS, hidden.shape[0]))
        self.group.broadcast(hidden.contiguous())

    def stop(self) -> None:
        self.group.host_broadcast(_header(OP_STOP))


class StepReceiver:
    """Worker side: the driver's next message: a step's `ModelInputs`, the
    hidden states of a logits computation, or None at shutdown."""

    def __init__(self, group: TPGroup, block_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.group, self.block_size = group, block_size
        self.hidden_size, self.dtype = hidden_size, dtype

    def receive(self) -> ModelInputs | torch.Tensor | None:
        header = self.group.host_broadcast(torch.empty(HEADER_LEN, dtype=torch.int64))
        op = int(header[0])
        if op == OP_LOGITS:
            hidden = torch.empty(int(header[1]), self.hidden_size, dtype=self.dtype, device=self.group.device)
            return self.group.broadcast(hidden)
        if op == OP_STOP:
            return None
        host = unpack(header, self.group.host_broadcast(torch.empty(int(header[1]), dtype=torch.int64)))
        inputs = inputs_for_rows(host, [], [], self.block_size, self.group.device)  # workers sample nothing
        if has_pending(host):
            self.group.broadcast(inputs.input_ids)
        return inputs
