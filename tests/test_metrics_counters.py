"""KV usage and fragmentation come from running counters, and step inputs'
block ids from a mirror of the tables: equal to a walk over every block table
(the definition) after every allocate/free of seeded random walks, and
readable without touching any table."""
from __future__ import annotations

import random

import pytest

from kvserve.cache.block_fill import BlockFill
from kvserve.cache.groups import make_kv_cache_groups
from kvserve.cache.host_tier import HostTier
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

FULL = FullAttentionSpec()
SPEC_SETS = {
    "full": [FULL],
    "sliding": [SlidingWindowSpec(12, sink=4)] * 2,
    "hybrid": [FULL, SlidingWindowSpec(10), FULL, SlidingWindowSpec(17, sink=3)],
}


def walked_fragmentation(manager: KVCacheManager) -> float:
    """The definition, as a walk over every held block (the code the counters replaced)."""
    used: dict[int, int] = {}
    for group in manager.managers:
        for request_id, table in group.req_to_blocks.items():
            end = manager._num_tokens.get(request_id, 0)
            for index, block in enumerate(table):
                if block.is_null:
                    continue
                slots = min(manager.block_size, max(0, end - index * manager.block_size))
                used[block.block_id] = max(used.get(block.block_id, 0), slots)
    if not used:
        return 0.0
    return 1.0 - sum(used.values()) / (len(used) * manager.block_size)


def walked_usage(manager: KVCacheManager) -> float:
    held = {b.block_id for g in manager.managers for t in g.req_to_blocks.values()
            for b in t if not b.is_null}
    return len(held) / (manager.pool.num_blocks - 1)


class Walk:
    """A scheduler-like driver: admissions (with prefix hits), chunks, decodes,
    over-scheduling (the end moves back), frees, recompute and swap preemption."""

    def __init__(self, manager: KVCacheManager, seed: int) -> None:
        self.manager, self.rng = manager, random.Random(seed)
        self.prefixes = [[self.rng.randrange(40) for _ in range(50)] for _ in range(3)]
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.next_id = 0

    def new_request(self) -> Request:
        self.next_id += 1
        prefix = self.rng.choice(self.prefixes)[:self.rng.randint(1, 50)]
        prompt = prefix + [self.rng.randrange(40) for _ in range(self.rng.randint(0, 10))]
        return Request(f"r{self.next_id}", prompt, SamplingParams(max_tokens=100))

    def admit(self, request: Request) -> None:
        computed, hit = self.manager.get_computed_blocks(request)
        chunk = self.rng.randint(1, request.num_tokens - hit)
        if self.manager.allocate_slots(request, chunk, computed):
            request.num_computed_tokens += hit
            self.running[request.request_id] = request
            self.advance(request, chunk)
        elif request.num_preemptions:
            self.waiting.append(request)

    def advance(self, request: Request, scheduled: int) -> None:
        # Sometimes fewer tokens are computed than scheduled: the next end is lower.
        done = scheduled if self.rng.random() < 0.8 else self.rng.randint(0, scheduled)
        request.num_computed_tokens += done
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(self.rng.randrange(40))

    def step(self) -> None:
        request = self.rng.choice(list(self.running.values()))
        num_new = self.rng.randint(0, min(request.num_tokens - request.num_computed_tokens, 20))
        if self.manager.allocate_slots(request, num_new):
            self.advance(request, num_new)
        else:
            self.preempt(request)

    def preempt(self, request: Request) -> None:
        del self.running[request.request_id]
        if self.manager.can_swap_out(request) and self.rng.random() < 0.5:
            self.manager.swap_out(request)
        else:
            self.manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.append(request)

    def finish(self) -> None:
        request = self.rng.choice(list(self.running.values()))
        del self.running[request.request_id]
        self.manager.free(request)

    def random_op(self) -> None:
        op = self.rng.choices(["admit", "resume", "step", "finish", "preempt"], [3, 2, 12, 2, 1])[0]
        if op == "admit" or not self.running:
            self.admit(self.new_request())
        elif op == "resume" and self.waiting:
            self.admit(self.waiting.pop(0))
        elif op == "step":
            self.step()
        elif op == "finish":
            self.finish()
        elif op == "preempt":
            self.preempt(self.rng.choice(list(self.running.values())))
        for request in [r for r in self.running.values() if r.num_tokens >= 100]:
            del self.running[request.request_id]
            self.manager.free(request)


@pytest.mark.parametrize("host_blocks", [0, 24])
@pytest.mark.parametrize("spec_set", sorted(SPEC_SETS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_counters_equal_the_walk(block_size: int, spec_set: str, host_blocks: int) -> None:
    groups = make_kv_cache_groups(SPEC_SETS[spec_set])
    num_blocks = len(groups) * 160 // block_size + 6
    host = HostTier(host_blocks, 1) if host_blocks else None
    manager = KVCacheManager(groups, num_blocks, block_size, host_tier=host)
    walk = Walk(manager, seed=block_size * 100 + len(spec_set) + host_blocks)
    seen = set()
    for _ in range(400):
        walk.random_op()
        assert manager.fragmentation() == walked_fragmentation(manager)
        assert manager.usage == pytest.approx(walked_usage(manager), abs=1e-12)
        for request in walk.running.values():
            assert manager.get_block_ids(request.request_id) == [
                [b.block_id for b in g.blocks(request.request_id)] for g in manager.managers]
        manager.check_integrity()  # also compares the mirror and counters with the tables
        seen.add(round(manager.fragmentation(), 3))
    for request in list(walk.running.values()) + walk.waiting:
        manager.free(request)
    assert manager.fragmentation() == walked_fragmentation(manager) == 0.0
    assert manager.usage == 0.0
    assert len(seen) > 10, "the walk never moved fragmentation: it tests nothing"


def test_counters_are_read_without_walking_tables() -> None:
    manager = KVCacheManager(make_kv_cache_groups([FULL, SlidingWindowSpec(8)]), 64, 4)
    request = Request("a", list(range(10)), SamplingParams(max_tokens=10))
    assert manager.allocate_slots(request, 10)
    expected = walked_fragmentation(manager)
    ids = [[b.block_id for b in g.blocks("a")] for g in manager.managers]
    assert expected > 0.0

    class NoWalk(dict):
        def _refuse(self, *args):
            raise AssertionError("a metric walked the block tables")
        items = values = keys = __iter__ = _refuse

    for group in manager.managers:
        group.req_to_blocks = NoWalk(group.req_to_blocks)
    assert manager.fragmentation() == expected
    assert manager.usage == pytest.approx(6 / 63)  # 3 blocks in each of 2 groups
    returned = manager.get_block_ids("a")
    assert returned == ids
    returned[0].append(99)  # a copy: the caller cannot corrupt the mirror
    assert manager.get_block_ids("a") == ids
    assert expected == pytest.approx(1 - 20 / 24)


def test_shared_block_counts_once_at_its_fullest() -> None:
    """BlockFill against a brute-force max over a random multiset of holders,
    shared partial blocks included (which the manager's walks rarely reach)."""
    rng = random.Random(0)
    fill, holders = BlockFill(block_size=8), []
    for _ in range(2000):
        if holders and rng.random() < 0.45:
            fill.remove(*holders.pop(rng.randrange(len(holders))))
        else:
            holders.append((rng.randrange(1, 12), rng.randint(0, 8)))
            fill.add(*holders[-1])
        largest: dict[int, int] = {}
        for block_id, f in holders:
            largest[block_id] = max(largest.get(block_id, 0), f)
        assert fill.largest_fills() == largest
        assert (fill.num_held, fill.used_slots) == (len(largest), sum(largest.values()))
    with pytest.raises(RuntimeError, match="no holder"):
        fill.remove(99, 3)


def test_engine_metrics_match_the_walk_every_step() -> None:
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(model="dummy:tiny-qwen3", device="cpu", block_size=4,
                                  num_kv_blocks=64, max_model_len=48, max_num_batched_tokens=24))
    rng = random.Random(3)
    shared = [rng.randrange(3, 256) for _ in range(9)]
    for i in range(6):
        prompt = shared[:rng.randint(1, 9)] + [rng.randrange(3, 256) for _ in range(rng.randint(1, 14))]
        engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=rng.randint(3, 12),
                                                                      ignore_eos=True)))
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        metrics, kv = engine.get_metrics(), engine.kv_cache
        assert metrics["kv_cache_fragmentation"] == walked_fragmentation(kv)
        assert metrics["kv_cache_usage_perc"] == pytest.approx(walked_usage(kv), abs=1e-12)
        seen.add(metrics["kv_cache_fragmentation"])
    assert engine.get_metrics()["kv_cache_fragmentation"] == 0.0 and len(seen) > 3


class _FakeEvent:
    """A CUDA event stand-in: `done` says whether the device reached it."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            raise AssertionError("the metrics snapshot waited for a copy in flight")

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return 2.0  # ms


def test_copy_metrics_snapshot_does_not_wait_for_copies_in_flight() -> None:
    import torch
    from kvserve.runner.kv_transfer import KVTransfer
    transfer = KVTransfer(torch.zeros(1, 2, 4, 2, 1, 2), 4, torch.device("cpu"))
    landed, in_flight = _FakeEvent(True), _FakeEvent(False)
    transfer._timings += [(_FakeEvent(True), landed), (_FakeEvent(True), in_flight)]
    assert transfer.metrics(wait=False)["kv_host_load_wait_s"] == pytest.approx(0.002)
    in_flight.done = True
    assert transfer.metrics()["kv_host_load_wait_s"] == pytest.approx(0.004)


def test_engine_snapshot_waits_for_copies_only_when_idle() -> None:
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(model="dummy:tiny-llama", device="cpu", num_kv_blocks=64,
                                  max_model_len=64, cpu_kv_cache_gb=0.001))
    waits = []
    metrics = engine.runner.kv_transfer.metrics
    engine.runner.kv_transfer.metrics = lambda wait=True: waits.append(wait) or metrics(wait)
    engine.add_request(engine.make_request([5, 6, 7, 8], SamplingParams(max_tokens=3)))
    while engine.has_unfinished_requests():
        engine.step()
        engine.get_metrics()
    assert waits[:-1] and not any(waits[:-1]) and waits[-1] is True
