"""Seeded random walk of a scheduler over the KV cache manager.

Mimics the scheduler's contract (get_computed_blocks + allocate_slots, then
advance num_computed_tokens) through admissions, chunked prefill, decode,
finish, abort, preemption and re-admission. Besides `check_integrity()` after
every step it checks the KV contents against `kv_walk.py`'s model.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvserve.cache.groups import make_kv_cache_groups
from kvserve.cache.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.request import Request
from kv_walk import WalkState, write_and_read

FULL = FullAttentionSpec()
SPEC_SETS = {
    "full": [FULL, FULL],
    "sliding": [SlidingWindowSpec(12, sink=4)] * 2,
    "hybrid": [FULL, SlidingWindowSpec(10), FULL, SlidingWindowSpec(17, sink=3)],
}
MAX_TOKENS = 110
STEPS = 250


@dataclass
class Walk(WalkState):
    num_hits: int = 0


def snapshot(manager: KVCacheManager, request_ids) -> tuple:
    pool = manager.pool
    return ([manager.get_block_ids(rid) for rid in request_ids], pool.num_free_blocks,
            pool.num_evictions, sorted(pool.cached), [b.ref_cnt for b in pool.blocks],
            [b.block_id for b in pool.free_queue])


def check_hit(walk: Walk, request: Request, computed: ComputedBlocks, hit: int) -> None:
    bs = walk.block_size
    assert hit % bs == 0 and hit <= request.num_tokens - 1
    tokens = request.all_token_ids
    for blocks in computed.blocks:
        assert len(blocks) * bs == hit
        for index, block in enumerate(blocks):
            if block.is_null:
                continue
            assert block.content.token_ids == tuple(tokens[index * bs:(index + 1) * bs])
            assert block.content.block_index == index


def admit(walk: Walk, request: Request) -> None:
    manager = walk.manager
    computed, hit = manager.get_computed_blocks(request)
    check_hit(walk, request, computed, hit)
    chunk = walk.rng.randint(1, request.num_tokens - hit)
    before = snapshot(manager, walk.running)
    if not manager.allocate_slots(request, chunk, computed):
        assert snapshot(manager, walk.running) == before
        assert manager.get_block_ids(request.request_id) == [[] for _ in manager.managers]
        return
    walk.num_hits += hit > 0
    manager.record_prefix_lookup(request, hit)
    request.num_computed_tokens += hit  # the scheduler's side of the contract
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = hit
    walk.running[request.request_id] = request
    compute(walk, request, chunk)


def compute(walk: Walk, request: Request, num_new: int) -> None:
    start = request.num_computed_tokens
    write_and_read(walk.manager, walk.kv, request, start, start + num_new)
    request.num_computed_tokens += num_new
    if request.num_computed_tokens == request.num_tokens:  # sampled a token
        request.output_token_ids.append(walk.rng.randrange(50))


def step_running(walk: Walk) -> None:
    request = walk.rng.choice(list(walk.running.values()))
    pending = request.num_tokens - request.num_computed_tokens
    num_new = walk.rng.randint(1, min(pending, 24))
    before = snapshot(walk.manager, walk.running)
    if walk.manager.allocate_slots(request, num_new):
        compute(walk, request, num_new)
    else:
        assert snapshot(walk.manager, walk.running) == before
        preempt(walk, request)


def preempt(walk: Walk, request: Request) -> None:
    walk.manager.free(request)
    del walk.running[request.request_id]
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    walk.waiting.append(request)


def finish(walk: Walk, abort: bool) -> None:
    candidates = [r for r in walk.running.values()
                  if not abort or r.num_computed_tokens < r.num_prompt_tokens]
    if not candidates:
        return
    request = walk.rng.choice(candidates)
    walk.manager.free(request)
    del walk.running[request.request_id]
    if not abort:
        # Multi-turn: the next turn re-sends the whole history.
        walk.history.append(request.all_token_ids)


def random_step(walk: Walk) -> None:
    rng = walk.rng
    op = rng.choices(["admit", "readmit", "resume", "step", "finish", "abort"],
                     weights=[3, 2, 1, 10, 2, 1])[0]
    if op == "admit" or (op == "readmit" and not walk.history):
        admit(walk, walk.new_request(walk.random_prompt(max_extra=12)))
    elif op == "readmit":
        admit(walk, walk.new_request(walk.next_turn_prompt(room=12)))
    elif op == "resume" and walk.waiting:
        admit(walk, walk.waiting.pop(0))
    elif op == "step" and walk.running:
        step_running(walk)
    elif op in ("finish", "abort"):
        finish(walk, abort=op == "abort")
    for request in list(walk.running.values()):
        if request.num_tokens >= MAX_TOKENS:
            walk.manager.free(request)
            del walk.running[request.request_id]


def run_walk(block_size: int, spec_set: str, caching: bool, seed: int, policy: str = "reuse") -> Walk:
    groups = make_kv_cache_groups(SPEC_SETS[spec_set])
    num_blocks = len(groups) * 200 // block_size + 8
    manager = KVCacheManager(groups, num_blocks, block_size, enable_prefix_caching=caching,
                             eviction_policy=policy)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(60)] for _ in range(3)]
    walk = Walk(manager, rng, prefixes, max_tokens=MAX_TOKENS, vocab=50)
    for _ in range(STEPS):
        random_step(walk)
        manager.check_integrity()
        assert 0.0 <= manager.fragmentation() < 1.0
    for request in list(walk.running.values()):
        manager.free(request)
    manager.check_integrity()
    assert manager.usage == 0.0 and manager.num_free_blocks == num_blocks - 1
    return walk


@pytest.mark.parametrize("caching, policy", [(True, "reuse"), (True, "lru"), (False, "reuse")])
@pytest.mark.parametrize("spec_set", sorted(SPEC_SETS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_walk(block_size: int, spec_set: str, caching: bool, policy: str) -> None:
    walk = run_walk(block_size, spec_set, caching, seed=block_size * 1000 + len(spec_set), policy=policy)
    if caching:
        assert walk.num_hits > 0 and walk.manager.prefix_cache_hits > 0
    else:
        assert walk.num_hits == 0 and walk.manager.num_evictions == 0
