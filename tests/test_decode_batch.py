"""A decode step's rows as arrays (`SchedulerOutput.decode`) against the
rows they stand for: random pipelined walks through the real scheduler and
KV cache (preemption, swaps, prefix hits, budget caps, unpipelined steps).
Whenever the scheduler sets them they must describe every row, and the batch
built from them must equal the one built row by row; in steady decode it
must set them."""
from __future__ import annotations

import random

import pytest
import torch

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


def _walk(seed: int) -> int:
    """A pipelined walk in the engine's order (schedule, update, mark the
    sampling rows pending, then resolve the step before: append, finish).
    Returns how many steps had decode arrays."""
    rng = random.Random(seed)
    s = _scheduler(rng, rng.choice([40, 60, 200]), rng.choice([0, 0, 64]), rng.choice([6, 16, 64, 512]))
    kv, shared, in_flight, num_decode = s.kv_cache, [rng.randrange(50) for _ in range(12)], [], 0
    for number in range(rng.randint(60, 160)):
        if rng.random() < 0.3:
            prompt = (shared[:rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 20))])
            s.add_request(Request(f"r{number}", prompt, SamplingParams(max_tokens=rng.randint(1, 30))))
        running = set(map(id, s.running))
        out = s.schedule()
        _check_decode_batch(out, kv, admitted=any(id(i.request) not in running for i in out.scheduled))
        num_decode += out.decode is not None
        kv.take_pending_copies()
        sampling = [item for item in out.scheduled if item.completes_sequence]
        launched = [item.request for item in sampling]
        if seed % 2:  # the engine's way: the sampling rows' pending tokens counted in the same call
            s.update_after_step(out, sampling)
        else:
            s.update_after_step(out)
            for request in launched:
                request.num_pending_tokens += 1
        for request in in_flight:
            _resolve(s, request, rng.randrange(50))
        in_flight = launched if rng.random() < 0.9 else _resolve_all(s, launched, rng)
        kv.check_integrity()
    return num_decode


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


def _check_decode_batch(out, kv: KVCacheManager, admitted: bool = False) -> None:
    """Set when every row computes its one last token (before
    `update_after_step`), unless a row was admitted this step (the arrays
    come from the running requests' loop); then its arrays describe every
    row, and the batch built from them equals the one built row by row."""
    rows, decode = out.scheduled, out.decode
    is_decode = bool(rows) and all(i.num_new_tokens == 1 and i.completes_sequence for i in rows)
    assert (decode is not None) == (is_decode and not admitted)
    if decode is None:
        return
    assert decode.num_rows == len(rows) and decode.starts.tolist() == [i.start_pos for i in rows]
    assert decode.on_device == all(i.start_pos >= i.request.num_known_tokens for i in rows)
    tables = kv.block_tables([i.request.request_id for i in rows])
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
def test_decode_arrays_describe_the_rows(seed):
    _walk(seed)


def test_steady_decode_gets_arrays():
    """The walks above do check some (the arrays are not simply never set)."""
    assert sum(_walk(seed) for seed in range(4)) > 40


def test_decode_rows_over_the_budget():
    """More decoding requests than budget: the first ones run, as decode rows."""
    kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), 200, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512), kv)
    for i in range(12):
        s.add_request(Request(f"r{i}", [i + 1] * (3 + i), SamplingParams(max_tokens=20)))
    s.update_after_step(s.schedule())  # every prompt in one step, under the budget
    s.config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16, max_model_len=512)
    for _ in range(4):
        for r in s.running:
            r.output_token_ids.append(5)
        out = s.schedule()
        assert [i.request.request_id for i in out.scheduled] == [f"r{i}" for i in range(8)]
        _check_decode_batch(out, kv)
        assert out.decode is not None and not out.decode.on_device
        s.update_after_step(out)


def test_a_streak_step_matches_the_step_in_flight_by_its_ids_list_only_when_it_is_the_same_list():
    """`_fill_pending`'s row match (`model_runner._same_rows`): the streak's own
    id list on both steps matches at once; any other list, an equal copy
    included, falls back to comparing the rows' requests."""
    import numpy as np
    from kvserve.runner.model_runner import InFlightStep, _same_rows
    from kvserve.scheduler import DecodeBatch, ScheduledRequest, SchedulerOutput
    a, b = (Request(i, [1, 2], SamplingParams()) for i in "ab")
    ids = ["a", "b"]
    out = SchedulerOutput([ScheduledRequest(a, 1, 2), ScheduledRequest(b, 1, 2)],
                          DecodeBatch(np.array([2, 2]), on_device=True), request_ids=ids)
    same = [ScheduledRequest(a, 1, 1), ScheduledRequest(b, 1, 1)]
    swapped = same[::-1]
    assert _same_rows(out, InFlightStep(swapped, None, request_ids=ids))   # the streak's list vouches
    assert not _same_rows(out, InFlightStep(swapped, None, request_ids=list(ids)))
    assert not _same_rows(out, InFlightStep(swapped, None))
    assert _same_rows(out, InFlightStep(same, None))
    out.decode = None   # not a decode step: never by the list
    assert not _same_rows(out, InFlightStep(swapped, None, request_ids=ids))
