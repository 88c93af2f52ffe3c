"""The scheduler's bulk decode path (`Scheduler._schedule_decodes`, with the
KV cache manager's `move_ends_within_tails`) against the per-request loop it
replaces (`_schedule_each`): random pipelined walks, run once with each path
from the same seed, must schedule, preempt, swap, cache and count the same,
step by step. Where the bulk path scheduled every row, the step's batch
built from its arrays (`SchedulerOutput.decode`) must equal the one built
row by row."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve import scheduler as scheduler_module
from kvserve.cache.groups import make_kv_cache_groups
from kvserve.cache.host_tier import HostTier
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec
from kvserve.config import SchedulerConfig
from kvserve.request import Request, RequestStatus
from kvserve.runner.batch import prepare_inputs
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import PreemptionCosts, Scheduler


def _scheduler(rng: random.Random, num_blocks: int, host_blocks: int, budget: int) -> Scheduler:
    host = HostTier(host_blocks, 1) if host_blocks else None
    kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), num_blocks, 4,
                        eviction_policy=rng.choice(["lru", "reuse"]), host_tier=host)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=24, max_model_len=512)
    return Scheduler(config, kv, PreemptionCosts(mode=rng.choice(["auto", "swap", "recompute"])))


def _walk(seed: int, bulk: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    """Trace of a pipelined walk: the engine's order (schedule, update, mark the
    sampling rows pending, then resolve the step before: append, finish)."""
    monkeypatch.setattr(scheduler_module, "BULK_DECODE_MIN", 1 if bulk else 10 ** 9)
    rng = random.Random(seed)
    s = _scheduler(rng, rng.choice([40, 60, 200]), rng.choice([0, 0, 64]), rng.choice([6, 16, 64, 512]))
    kv, shared, trace, in_flight = s.kv_cache, [rng.randrange(50) for _ in range(12)], [], []
    for number in range(rng.randint(60, 160)):
        if rng.random() < 0.3:
            prompt = (shared[:rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 20))])
            s.add_request(Request(f"r{number}", prompt, SamplingParams(max_tokens=rng.randint(1, 30))))
        out = s.schedule()
        if out.decode is not None:
            _check_decode_batch(out, kv)
        copies = kv.take_pending_copies()
        s.update_after_step(out)
        launched = [item.request for item in out.scheduled if item.completes_sequence]
        for request in launched:
            request.num_pending_tokens += 1
        trace.append(_state(s, out, copies))
        for request in in_flight:
            _resolve(s, request, rng.randrange(50))
        in_flight = launched if rng.random() < 0.9 else _resolve_all(s, launched, rng)
        kv.check_integrity()
    return trace


def _resolve(s: Scheduler, request: Request, token: int) -> None:
    if request.is_finished:
        return
    request.num_pending_tokens -= 1
    request.output_token_ids.append(token)
    if request.num_output_tokens >= request.sampling_params.max_tokens:
        s.remove_finished(request, RequestStatus.FINISHED_LENGTH)


def _resolve_all(s: Scheduler, launched: list[Request], rng: random.Random) -> list[Request]:
    """An unpipelined step now and then: known last tokens, tails that fill up."""
    for request in launched:
        _resolve(s, request, rng.randrange(50))
    return []


def _state(s: Scheduler, out, copies) -> tuple:
    kv = s.kv_cache
    ids = sorted(kv._num_tokens)
    events = [(r.request_id, [e[1:] for e in r.events]) for r in s.running]
    return (events, [(i.request.request_id, i.num_new_tokens, i.start_pos) for i in out.scheduled],
            [r.request_id for r in out.preempted], [r.request_id for r in s.running],
            [r.request_id for r in s.waiting], kv.num_free_blocks, kv.fragmentation(),
            kv.prefix_cache_hits, kv.num_evictions, s.num_swap_preemptions, str(copies),
            [(i, kv._num_tokens[i], kv.get_block_ids(i)) for i in ids])


def _check_decode_batch(out, kv: KVCacheManager) -> None:
    """The bulk rows' arrays describe every row, and the batch built from them
    equals the one built row by row (before `update_after_step`)."""
    rows, decode = out.scheduled, out.decode
    assert decode.request_ids == [i.request.request_id for i in rows]
    assert decode.starts.tolist() == [i.start_pos for i in rows]
    assert decode.num_known.tolist() == [i.request.num_known_tokens for i in rows]
    assert all(i.num_new_tokens == 1 and i.completes_sequence for i in rows)
    tables = kv.block_tables(decode.request_ids)
    fast = prepare_inputs(rows, tables, 4, torch.device("cpu"), decode)
    slow = prepare_inputs(rows, tables, 4, torch.device("cpu"))
    assert fast.sampling_rows == slow.sampling_rows
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "seq_idx"):
        a, b = getattr(fast.host, name), getattr(slow.host, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (fast.host.query_lens, fast.host.seq_lens_list) == (slow.host.query_lens, slow.host.seq_lens_list)
    assert all(torch.equal(a, b) for a, b in zip(fast.meta.slot_mappings, slow.meta.slot_mappings))


@pytest.mark.parametrize("seed", range(40))
def test_bulk_decode_path_matches_the_per_request_loop(seed, monkeypatch):
    assert _walk(seed, True, monkeypatch) == _walk(seed, False, monkeypatch)


def test_bulk_decode_path_runs_in_steady_decode(monkeypatch):
    """The walks above do take the bulk path (it is not always declined)."""
    calls = []
    bulk = Scheduler._schedule_decodes

    def counted(self, out, budget):
        left = bulk(self, out, budget)
        calls.append(left is not None)
        return left
    monkeypatch.setattr(Scheduler, "_schedule_decodes", counted)
    _walk(1, True, monkeypatch)
    assert sum(calls) > 10


def _decode_rows_over_budget(bulk: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setattr(scheduler_module, "BULK_DECODE_MIN", 1 if bulk else 10 ** 9)
    kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), 200, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512), kv)
    for i in range(12):
        s.add_request(Request(f"r{i}", [i + 1] * (3 + i), SamplingParams(max_tokens=20)))
    s.update_after_step(s.schedule())  # every prompt in one step, under the budget
    s.config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16, max_model_len=512)
    trace = []
    for _ in range(4):
        for r in s.running:
            r.output_token_ids.append(5)
        out = s.schedule()
        s.update_after_step(out)
        trace.append(_state(s, out, None))
    return trace


def test_decode_rows_over_the_budget(monkeypatch):
    """More decoding requests than budget: the first ones run, in order."""
    assert _decode_rows_over_budget(True, monkeypatch) == _decode_rows_over_budget(False, monkeypatch)
