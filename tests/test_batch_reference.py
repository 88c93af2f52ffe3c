"""`runner/batch.py` against a brute-force reference: a step's inputs worked out
token by token in plain Python (ids, positions, each token's sequence, cache
slots, the rows that sample and their logits rows), every field and dtype of
`prepare_inputs`' result compared with it, on random mixed and decode batches
through each path (`DecodeBatch` with the tokens on the device or on the host,
and none). Also the shared row ranges as they grow."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvserve.request import PENDING_TOKEN, Request
from kvserve.runner import batch
from kvserve.runner.batch import _row_ranges, prepare_inputs
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import DecodeBatch, ScheduledRequest

BLOCK = 4
CPU = torch.device("cpu")


def _request(rng: random.Random, name: str, num_prompt: int, num_output: int, pending: int) -> Request:
    request = Request(name, [rng.randrange(1, 500) for _ in range(num_prompt)], SamplingParams(max_tokens=64))
    request.output_token_ids.extend(rng.randrange(1, 500) for _ in range(num_output))
    request.num_pending_tokens = pending
    return request


def _row(rng: random.Random, name: str, kind: str, pending: bool) -> ScheduledRequest:
    """A row of `kind`: "decode", its one last token (pending or known); "prefill", a
    prompt chunk, which ends at the request's last token (samples) or before it (does
    not); "resumed", a chunk of a request with output tokens (a preempted one computed
    again), from anywhere in its prompt or outputs, which may cross into the outputs and
    end on the pending token."""
    num_prompt = rng.randint(1, 30)
    if kind == "prefill":
        request = _request(rng, name, num_prompt, 0, 0)
        start = rng.randrange(num_prompt)
        return ScheduledRequest(request, rng.randint(1, num_prompt - start), start)
    request = _request(rng, name, num_prompt, rng.randint(1, 9), int(pending))
    if kind == "decode":
        return ScheduledRequest(request, 1, request.num_tokens - 1)
    start = rng.randrange(request.num_tokens)
    return ScheduledRequest(request, rng.randint(1, request.num_tokens - start), start)


def _tables(rng: random.Random, rows: list[ScheduledRequest], groups: int) -> list[torch.Tensor]:
    """A group's table with random distinct block ids covering each row's tokens, padded
    with 0 to a width past the longest row."""
    width = max(-(-(s.start_pos + s.num_new_tokens) // BLOCK) for s in rows) + rng.randint(0, 2)
    ids = rng.sample(range(1, 10_000), groups * len(rows) * width)
    return [torch.tensor(ids[g * len(rows) * width:(g + 1) * len(rows) * width],
                         dtype=torch.int32).view(len(rows), width) for g in range(groups)]


def _reference(rows: list[ScheduledRequest], tables: list[torch.Tensor]) -> dict:
    """What each field must be, token by token."""
    ids, positions, seq_idx, logits_rows, sampling = [], [], [], [], []
    for i, s in enumerate(rows):
        known = s.request.prompt_token_ids + s.request.output_token_ids
        for pos in range(s.start_pos, s.start_pos + s.num_new_tokens):
            ids.append(known[pos] if pos < len(known) else PENDING_TOKEN)
            positions.append(pos)
            seq_idx.append(i)
        if s.start_pos + s.num_new_tokens == s.request.num_tokens:
            logits_rows.append(len(ids) - 1)
            sampling.append(s)
    slots = [[int(t[i, p // BLOCK]) * BLOCK + p % BLOCK for i, p in zip(seq_idx, positions)] for t in tables]
    query_lens = [s.num_new_tokens for s in rows]
    seq_lens = [s.start_pos + s.num_new_tokens for s in rows]
    return {"ids": ids, "positions": positions, "seq_idx": seq_idx, "logits": logits_rows, "sampling": sampling,
            "slots": slots, "query_lens": query_lens, "seq_lens": seq_lens,
            "query_start_loc": [0] + list(np.cumsum(query_lens))}


def _check(out, want: dict, rows: list[ScheduledRequest], tables: list[torch.Tensor]) -> None:
    def same(tensor: torch.Tensor, values: list, dtype: torch.dtype, name: str) -> None:
        assert tensor.dtype == dtype, f"{name}: {tensor.dtype}, want {dtype}"
        assert tensor.tolist() == [int(v) for v in values], name

    same(out.input_ids, want["ids"], torch.int64, "input_ids")
    same(out.positions, want["positions"], torch.int64, "positions")
    same(out.logits_indices, want["logits"], torch.int64, "logits_indices")
    assert out.sampling_rows == want["sampling"]
    host, meta = out.host, out.meta
    same(host.input_ids, want["ids"], torch.int64, "host.input_ids")
    same(host.positions, want["positions"], torch.int64, "host.positions")
    same(host.seq_idx, want["seq_idx"], torch.int64, "host.seq_idx")
    same(host.query_start_loc, want["query_start_loc"], torch.int32, "host.query_start_loc")
    same(host.seq_lens, want["seq_lens"], torch.int32, "host.seq_lens")
    assert host.query_lens == want["query_lens"] and host.seq_lens_list == want["seq_lens"]
    assert (meta.num_seqs, meta.num_tokens, meta.block_size) == (len(rows), len(want["ids"]), BLOCK)
    same(meta.query_start_loc, want["query_start_loc"], torch.int32, "meta.query_start_loc")
    same(meta.seq_lens, want["seq_lens"], torch.int32, "meta.seq_lens")
    assert (meta.max_query_len, meta.max_seq_len) == (max(want["query_lens"]), max(want["seq_lens"]))
    assert meta.query_lens_cpu == want["query_lens"] and meta.seq_lens_cpu == want["seq_lens"]
    assert len(meta.block_tables) == len(tables) and len(meta.slot_mappings) == len(tables)
    for got, table in zip(meta.block_tables, tables):
        assert got.dtype == torch.int32 and torch.equal(got, table)
    for g, slots in enumerate(meta.slot_mappings):
        same(slots, want["slots"][g], torch.int64, f"slot_mappings[{g}]")


@pytest.mark.parametrize("seed", range(60))
def test_a_mixed_step_matches_the_reference(seed):
    rng = random.Random(seed)
    kinds = ("decode", "prefill", "resumed")
    rows = [_row(rng, f"r{i}", rng.choice(kinds), rng.random() < 0.5) for i in range(rng.randint(1, 12))]
    if all(s.num_new_tokens == 1 for s in rows):   # a chunk of two or more: the general path
        request = _request(rng, "chunk", 12, 0, 0)
        rows.append(ScheduledRequest(request, 5, 3))
    tables = _tables(rng, rows, rng.choice([1, 2]))
    _check(prepare_inputs(rows, tables, BLOCK, CPU), _reference(rows, tables), rows, tables)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("path", ["on device", "on host", "rows alone"])
def test_a_decode_step_matches_the_reference_on_each_path(seed, path):
    """The decode arrays with every token pending (the pipelined steady state), with the
    tokens looked up, and no arrays (the rows alone): each the same batch, `kept_rows`
    carried along where given."""
    rng = random.Random(seed)
    rows = [_row(rng, f"r{i}", "decode", path == "on device" or rng.random() < 0.5)
            for i in range(rng.randint(1, 40))]
    tables = _tables(rng, rows, rng.choice([1, 2]))
    starts = np.array([s.start_pos for s in rows], dtype=np.int64)
    decode = None if path == "rows alone" else DecodeBatch(starts, on_device=path == "on device")
    kept = np.array(rng.sample(range(64), len(rows)), dtype=np.int64) if rng.random() < 0.5 else None
    out = prepare_inputs(rows, tables, BLOCK, CPU, decode, kept)
    _check(out, _reference(rows, tables), rows, tables)
    assert starts.tolist() == [s.start_pos for s in rows]   # the scheduler's array is not written to
    if kept is None or decode is None:
        assert out.kept_rows is None
    else:
        assert out.kept_rows.dtype == torch.int64 and out.kept_rows.tolist() == kept.tolist()


def test_the_shared_row_ranges_cover_every_size_as_they_grow(monkeypatch):
    monkeypatch.setattr(batch, "_ROW_RANGES", {})
    monkeypatch.setattr(batch, "_ALL_ROWS", [])
    for n in (3, 1, 256, 257, 255, 600, 1200, 1201, 5, 1201):
        ranges = _row_ranges(n)
        assert ranges.query_start_loc.dtype == torch.int32 and ranges.rows.dtype == torch.int64
        assert ranges.query_start_loc.tolist() == list(range(n + 1)), n
        assert ranges.rows.tolist() == list(range(n)), n

