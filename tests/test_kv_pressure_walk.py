"""Random walks over both KV tiers: GPU pool + host tier, with evictions to
host, host hits, swap-out/swap-in and recompute preemption.

The walk simulates the KV contents of every GPU slot (`kv_walk.py`'s model)
and host slot, executes the queued block copies before each computation (what
the runner does before a forward; write-backs as late as allowed), and checks
that every key a query reads holds exactly the request's prefix. Integrity is
checked after every operation.

Load-ahead admission (scheduler.py) is walked too: a deferred request takes
only its hit blocks, and its copies are a prefetch held back as long as the
engine allows: through one more computation of an already-running request
(the step in which it was admitted), landing before anything else computes,
before any later copy (one copy stream), and before any other operation's
computation (the next step's forward waits for it).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvserve.cache.groups import make_kv_cache_groups
from kvserve.cache.host_tier import BlockCopy, HostTier
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kv_walk import WalkState, write_and_read

FULL = FullAttentionSpec()
SPEC_SETS = {"full": [FULL, FULL], "hybrid": [FULL, SlidingWindowSpec(10), FULL, SlidingWindowSpec(17, sink=3)]}
MAX_TOKENS = 90
STEPS = 1200


@dataclass
class TierWalk(WalkState):
    host_kv: dict[tuple[int, int], tuple[int, ...] | None] = field(default_factory=dict)
    in_flight: list[tuple[int, BlockCopy]] = field(default_factory=list)  # (batch, write-back)
    prefetch: list[BlockCopy] = field(default_factory=list)  # a held load-ahead batch
    loading: set[str] = field(default_factory=set)  # requests admitted by it
    grace: bool = False  # the step it was issued in has not computed yet
    stranded: int = 0
    deferred: int = 0


def run_copies(walk: TierWalk) -> None:
    """The runner's part, with adversarial timing for write-backs: urgent
    copies run in queue order before the computation, write-backs land as late
    as the streams allow (only when a fence waits for them, or at the very
    end), so a missing fence shows up as wrong KV read back later."""
    batch = walk.manager.take_pending_copies()
    if batch:
        land_prefetch(walk)  # queued earlier on the same copy stream
    while walk.in_flight and walk.in_flight[0][0] <= batch.fence:
        execute_copy(walk, walk.in_flight.pop(0)[1])
    if batch.fence == batch.index:  # fenced on itself: all of it, in queue order
        for copy in batch.copies:
            execute_copy(walk, copy)
        return
    for copy in batch.copies:
        if not copy.background:
            execute_copy(walk, copy)
    walk.in_flight += [(batch.index, copy) for copy in batch.copies if copy.background]


def land_prefetch(walk: TierWalk) -> None:
    for copy in walk.prefetch:
        execute_copy(walk, copy)
    walk.prefetch, walk.loading, walk.grace = [], set(), False


def land_all(walk: TierWalk) -> None:
    land_prefetch(walk)
    run_copies(walk)
    for _, copy in walk.in_flight:
        execute_copy(walk, copy)
    walk.in_flight.clear()


def execute_copy(walk: TierWalk, copy: BlockCopy) -> None:
    for offset in range(walk.block_size):
        gpu, host = (copy.gpu_block, offset), (copy.host_slot, offset)
        if copy.to_host:
            walk.host_kv[host] = walk.kv.get(gpu)
        else:
            value = walk.host_kv.get(host)
            if value is None:
                walk.kv.pop(gpu, None)
            else:
                walk.kv[gpu] = value


def compute(walk: TierWalk, request: Request, num_new: int) -> None:
    run_copies(walk)
    if not walk.grace or request.request_id in walk.loading:
        land_prefetch(walk)
    walk.grace = False
    start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
    write_and_read(walk.manager, walk.kv, request, start, end)
    request.num_computed_tokens = end
    if end == request.num_tokens:
        request.output_token_ids.append(walk.rng.randrange(40))


def admit(walk: TierWalk, request: Request) -> None:
    manager = walk.manager
    computed, hit = manager.get_computed_blocks(request)
    chunk = walk.rng.randint(1, request.num_tokens - hit)
    if not manager.allocate_slots(request, chunk, computed):
        return walk.waiting.append(request) if request.num_preemptions else None
    manager.record_prefix_lookup(request, hit, computed)
    request.num_computed_tokens = hit
    walk.running[request.request_id] = request
    compute(walk, request, chunk)


def defer_admit(walk: TierWalk, request: Request) -> None:
    """Load-ahead admission: room for the whole first chunk, only the hit taken
    now; the copies become the held prefetch (module doc)."""
    manager = walk.manager
    land_prefetch(walk)  # one held prefetch at a time
    run_copies(walk)  # what the step's forward waits for
    computed, hit = manager.get_computed_blocks(request)
    chunk = walk.rng.randint(1, request.num_tokens - hit)
    if not (manager.can_allocate(request, chunk, computed) and manager.allocate_slots(request, 0, computed)):
        return walk.waiting.append(request) if request.num_preemptions else None
    manager.record_prefix_lookup(request, hit, computed)
    request.num_computed_tokens = hit
    walk.running[request.request_id] = request
    batch = manager.take_pending_copies()
    while walk.in_flight and walk.in_flight[0][0] <= batch.fence:
        execute_copy(walk, walk.in_flight.pop(0)[1])
    walk.prefetch = [c for c in batch.copies if batch.fence == batch.index or not c.background]
    walk.in_flight += [(batch.index, c) for c in batch.copies if c not in walk.prefetch]
    walk.loading.add(request.request_id)
    walk.grace = True
    walk.deferred += 1


def preempt(walk: TierWalk, request: Request) -> None:
    if walk.manager.can_swap_out(request) and walk.rng.random() < 0.6:
        walk.manager.swap_out(request)
    else:
        walk.manager.free(request)
    del walk.running[request.request_id]
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    walk.waiting.append(request)


def step(walk: TierWalk) -> None:
    request = walk.rng.choice(list(walk.running.values()))
    num_new = walk.rng.randint(1, min(request.num_tokens - request.num_computed_tokens, 20))
    if walk.manager.allocate_slots(request, num_new):
        compute(walk, request, num_new)
    else:
        preempt(walk, request)


def finish(walk: TierWalk, request: Request, keep: bool) -> None:
    walk.manager.free(request)
    walk.running.pop(request.request_id, None)
    if request in walk.waiting:
        walk.waiting.remove(request)
    if keep:
        walk.history.append(request.all_token_ids)


def random_op(walk: TierWalk) -> None:
    rng = walk.rng
    op = rng.choices(["new", "turn", "resume", "defer", "step", "preempt", "finish", "abort"],
                     weights=[3, 3, 2, 2, 10, 1, 2, 1])[0]
    if op != "step":
        walk.grace = False  # only the admitting step's own forward may skip the prefetch
    if op == "new" or (op == "turn" and not walk.history):
        admit(walk, walk.new_request(walk.random_prompt(max_extra=9)))
    elif op == "turn":
        admit(walk, walk.new_request(walk.next_turn_prompt(room=10)))
    elif op == "resume" and walk.waiting:
        admit(walk, walk.waiting.pop(0))
    elif op == "defer" and (walk.waiting or walk.history):
        request = walk.waiting.pop(0) if walk.waiting else walk.new_request(walk.next_turn_prompt(room=10))
        defer_admit(walk, request)
    elif op == "step" and walk.running:
        step(walk)
    elif op == "preempt" and walk.running:
        preempt(walk, rng.choice(list(walk.running.values())))
    elif op in ("finish", "abort") and (walk.running or walk.waiting):
        finish(walk, rng.choice(list(walk.running.values()) + walk.waiting), keep=op == "finish")
    for request in list(walk.running.values()):
        if request.num_tokens >= MAX_TOKENS:
            finish(walk, request, keep=True)


def watch_evictions(walk: TierWalk) -> None:
    """Count evictions of a parent while a free cached leaf could have gone."""
    pool, save = walk.manager.pool, walk.manager.pool.on_evict

    def on_evict(block):
        if block.num_children and any(b.num_children == 0 for b in pool.free_queue):
            walk.stranded += 1
        save(block)
    pool.on_evict = on_evict


def run_walk(spec_set: str, policy: str, block_size: int, host_blocks: int, seed: int) -> TierWalk:
    groups = make_kv_cache_groups(SPEC_SETS[spec_set])
    num_blocks = len(groups) * 140 // block_size + 6
    manager = KVCacheManager(groups, num_blocks, block_size, eviction_policy=policy,
                             host_tier=HostTier(host_blocks, 1))
    rng = random.Random(seed)
    walk = TierWalk(manager, rng, [[rng.randrange(40) for _ in range(50)] for _ in range(3)],
                    max_tokens=MAX_TOKENS, vocab=40)
    watch_evictions(walk)
    for _ in range(STEPS):
        random_op(walk)
        manager.check_integrity()
    for request in list(walk.running.values()) + list(walk.waiting):
        finish(walk, request, keep=False)
    land_all(walk)
    manager.check_integrity()
    assert manager.num_free_blocks == num_blocks - 1 and not manager._swapped
    assert manager.host_tier.num_free_for_swap() == manager.host_tier.num_blocks  # no private slot left
    return walk


@pytest.mark.parametrize("spec_set", sorted(SPEC_SETS))
@pytest.mark.parametrize("policy", ["lru", "reuse"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_tier_random_walk(spec_set: str, policy: str, seed: int) -> None:
    walk = run_walk(spec_set, policy, block_size=4, host_blocks=60, seed=10 * seed + len(spec_set) + len(policy))
    manager = walk.manager
    assert manager.host_hit_tokens > 0, "the walk never hit the host tier"
    assert manager.num_swap_outs > 0 and manager.num_swap_ins > 0
    assert manager.host_tier.num_evictions > 0, "the host tier never filled"
    if policy == "reuse":
        assert walk.stranded == 0
    assert walk.deferred > 0, "the walk never admitted ahead of a load"


def test_walks_drop_swaps_whose_prefix_left_both_tiers() -> None:
    """A swap copies only the tail past its cached prefix; in these walks some
    prefixes leave both tiers before the swap-in, which then resumes from
    what is left (the path the walks above must also get right)."""
    walks = [run_walk(spec_set, "reuse", block_size=4, host_blocks=60, seed=s)
             for spec_set in sorted(SPEC_SETS) for s in (1, 2)]
    assert sum(w.manager.num_swap_drops for w in walks) > 0


def test_lru_does_strand_children() -> None:
    """The check above is not vacuous: plain LRU evicts parents of free leaves
    (rarely in these small walks, so over a few seeds)."""
    stranded = [run_walk("full", "lru", block_size=4, host_blocks=60, seed=s).stranded for s in range(1, 7)]
    assert sum(stranded) > 0


@pytest.mark.parametrize("spec_set", sorted(SPEC_SETS))
@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_fences_under_a_small_host_tier(spec_set: str, policy: str) -> None:
    """A 16-slot host tier reuses slots and evicts written-back blocks all the
    time, so the fences are what keep the KV right: without the host-slot
    fence 18 of these 24 walks fail, without the evicted-GPU-block fence 23
    (docs/TESTING.md); the 60-slot walks above catch the first far less often."""
    walks = [run_walk(spec_set, policy, block_size=4, host_blocks=16, seed=seed) for seed in range(6)]
    assert all(w.manager.host_tier.num_evictions > 0 for w in walks)
    assert sum(w.manager.host_hit_tokens for w in walks) > 0


def test_reset_fences_on_every_write_back() -> None:
    """After a reset, slots and GPU blocks are reused without an eviction (no
    save to fence on), so the next batch must wait for all write-backs."""
    tier = HostTier(4, 1)
    manager = KVCacheManager(make_kv_cache_groups([FULL]), 8, 4, host_tier=tier)
    request = Request("a", list(range(9)), SamplingParams(max_tokens=4))
    assert manager.allocate_slots(request, 9)
    manager.free(request)  # two cached blocks become free: two write-backs
    first = manager.take_pending_copies()
    assert [c.background for c in first.copies] == [True, True] and first.fence == -1
    assert manager.take_pending_copies().fence == -1  # nothing conflicts yet
    assert manager.reset_prefix_cache()
    assert manager.take_pending_copies().fence == first.index
