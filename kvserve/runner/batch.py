"""Batch preparation: scheduled requests -> flat input tensors + attention metadata.

Everything is built on the host in a few vectorized ops and moved to the
device once per tensor; slot mappings are derived from block tables on the
device, so there is no per-token Python loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.scheduler import ScheduledRequest


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Row of the hidden states to sample from, one per sampling request.
    logits_indices: torch.Tensor
    sampling_rows: list[ScheduledRequest]


def prepare_inputs(scheduled: list[ScheduledRequest], block_ids: list[list[list[int]]],
                   block_size: int, num_groups: int, device: torch.device) -> ModelInputs:
    """block_ids[i][g] is request i's block table for KV group g."""
    query_lens = [s.num_new_tokens for s in scheduled]
    seq_lens = [s.start_pos + s.num_new_tokens for s in scheduled]
    tokens: list[int] = []
    for s in scheduled:
        tokens.extend(s.request.all_token_ids[s.start_pos:s.start_pos + s.num_new_tokens])
    q_lens = torch.tensor(query_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    seq_idx = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens)
    starts = torch.tensor([s.start_pos for s in scheduled], dtype=torch.int64)
    positions = starts[seq_idx] + (torch.arange(len(tokens)) - query_start_loc[:-1].long()[seq_idx])
    tables = [_pad_tables([ids[g] for ids in block_ids]) for g in range(num_groups)]
    slots = [tbl[seq_idx, positions // block_size].long() * block_size + positions % block_size
             for tbl in tables]
    last = query_start_loc[1:].long() - 1
    rows = [i for i, s in enumerate(scheduled) if s.completes_sequence]
    meta = AttentionMetadata(
        num_seqs=len(scheduled), num_tokens=len(tokens), block_size=block_size,
        query_start_loc=query_start_loc.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=[t.to(device) for t in tables], slot_mappings=[s.to(device) for s in slots],
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
    return ModelInputs(
        input_ids=torch.tensor(tokens, dtype=torch.long).to(device), positions=positions.to(device),
        meta=meta, logits_indices=last[rows].to(device), sampling_rows=[scheduled[i] for i in rows])


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    out = torch.zeros(len(tables), max(width, 1), dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out
