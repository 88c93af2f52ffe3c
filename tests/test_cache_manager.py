"""KVCacheManager: prefix hits, sliding-window memory bound, hybrid groups."""
from __future__ import annotations

import importlib
import math

import pytest

from kvserve.cache.groups import KVCacheGroup, make_kv_cache_groups
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

FULL = FullAttentionSpec()


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000))


def _admit(manager: KVCacheManager, request: Request) -> int:
    """Scheduler-style admission: whole prompt in one step."""
    computed, hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit, computed)
    manager.record_prefix_lookup(request, hit)
    request.num_computed_tokens = request.num_tokens
    manager.check_integrity()
    return hit


def _decode(manager: KVCacheManager, request: Request, token: int) -> None:
    request.output_token_ids.append(token)
    assert manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    manager.check_integrity()


def test_full_attention_prefix_hit():
    manager = KVCacheManager(make_kv_cache_groups([FULL] * 3), num_blocks=32, block_size=4)
    assert _admit(manager, _request("a", list(range(10)))) == 0
    # Shares two full blocks and part of the third: only full blocks hit.
    assert _admit(manager, _request("b", list(range(10)) + [99])) == 8
    assert _admit(manager, _request("c", list(range(6)) + [50, 51])) == 4
    # Exactly two full blocks: capped at num_tokens - 1, so one block hits.
    assert _admit(manager, _request("d", list(range(8)))) == 4
    assert manager.prefix_cache_queries == 10 + 11 + 8 + 8
    assert manager.prefix_cache_hits == 8 + 4 + 4
    ids = manager.get_block_ids("b")
    assert ids[0][:2] == manager.get_block_ids("a")[0][:2]


def test_prefix_caching_off_never_hits():
    manager = KVCacheManager(make_kv_cache_groups([FULL]), 32, 4, enable_prefix_caching=False)
    _admit(manager, _request("a", list(range(10))))
    assert _admit(manager, _request("b", list(range(10)))) == 0
    assert manager.prefix_cache_queries == 0


def test_freed_prefix_hits_after_finish():
    manager = KVCacheManager(make_kv_cache_groups([FULL]), 8, 4)
    first = _request("a", list(range(13)))
    _admit(manager, first)
    manager.free(first)
    manager.free(first)  # idempotent
    assert manager.usage == 0.0
    assert _admit(manager, _request("b", list(range(13)))) == 12


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("sink", [0, 20])
def test_sliding_window_memory_bound(block_size, sink):
    window = 40
    spec = SlidingWindowSpec(window, sink)
    manager = KVCacheManager(make_kv_cache_groups([spec] * 2), 600, block_size)
    request = _request("a", [7] * 5)
    _admit(manager, request)
    peak = 0
    for step in range(500):
        query = request.num_computed_tokens
        _decode(manager, request, step % 50)
        # Exactly the blocks of keys [query - window + 1, query] and of the sink.
        keys = set(range(max(0, query - window + 1), query + 1)) | set(range(min(sink, query + 1)))
        held = {i for i, b in enumerate(manager.get_block_ids("a")[0]) if b != 0}
        assert held == {k // block_size for k in keys}, step
        peak = max(peak, len(held))
    # A window of 40 keys straddles at most cdiv(39, block_size) + 1 blocks.
    assert peak == math.ceil((window - 1) / block_size) + 1 + math.ceil(sink / block_size)
    assert manager.num_blocks_needed(10_000) == peak  # both layers share one group
    manager.free(request)
    assert manager.usage == 0.0


def test_sliding_hit_needs_window_and_sink():
    spec = SlidingWindowSpec(window=8, sink=4)
    manager = KVCacheManager(make_kv_cache_groups([spec]), 64, 4)
    prompt = list(range(40))
    first = _request("a", prompt)
    # Prefill in chunks of 8 so every block is cached once computed.
    for _ in range(5):
        assert manager.allocate_slots(first, 8)
        first.num_computed_tokens += 8
    manager.free(first)
    computed, hit = manager.get_computed_blocks(_request("b", prompt))
    assert hit == 36
    ids = computed.block_ids()[0]
    # Sink block kept, blocks wholly before the window NULL, window blocks real.
    assert ids[0] != 0 and ids[-2:] == [b for b in ids[-2:] if b != 0]
    assert 0 in ids[1:-2]
    # Without the sink block no length is a valid hit.
    _evict(manager, manager.pool.blocks[ids[0]])
    assert manager.get_computed_blocks(_request("c", prompt))[1] == 0


def _evict(manager: KVCacheManager, block) -> None:
    """Drop a free cached block's hash as if it had been reclaimed."""
    manager.pool.free_queue.remove(block)
    manager.pool._drop_cached(block)
    manager.pool.free_queue.append(block)


def test_hybrid_hit_valid_for_every_group():
    specs = [FULL, SlidingWindowSpec(8)] * 2
    groups = make_kv_cache_groups(specs)
    manager = KVCacheManager(groups, 64, 4)
    prompt = list(range(30))
    first = _request("a", prompt)
    _admit(manager, first)  # one chunk: every full block cached in both groups
    second = _request("b", prompt + [1, 2, 3])
    computed, hit = manager.get_computed_blocks(second)
    assert hit == 28
    full_ids, sliding_ids = computed.block_ids()
    assert len(full_ids) == len(sliding_ids) == 7 and 0 not in full_ids
    assert sliding_ids[-2:] == manager.get_block_ids("a")[1][5:7]
    assert manager.allocate_slots(second, second.num_tokens - hit, computed)
    manager.check_integrity()


def test_hybrid_hit_shrinks_to_sliding_validity():
    manager = KVCacheManager(make_kv_cache_groups([FULL, SlidingWindowSpec(4)]), 64, 4)
    first = _request("a", list(range(24)))
    for _ in range(3):  # chunks of 8; the last chunk's blocks stay cached
        assert manager.allocate_slots(first, 8)
        first.num_computed_tokens += 8
    manager.free(first)
    # Evict the sliding group's last block only (the full group keeps its copy).
    victim = next(b for (g, _), b in manager.pool.cached.items()
                  if g == 1 and b.content.block_index == 5)
    _evict(manager, victim)
    computed, hit = manager.get_computed_blocks(_request("b", list(range(24)) + [5]))
    # The full group alone would hit 24 tokens; a query at 24 reads block 5 in the
    # sliding group, so both settle on 20, whose window [16, 20) is block 4.
    assert hit == 20 and len(computed.blocks[0]) == len(computed.blocks[1]) == 5
    assert computed.block_ids()[1][:4] == [0, 0, 0, 0]


def test_make_kv_cache_groups_shapes():
    full_only = make_kv_cache_groups([FULL] * 6)
    assert full_only == [KVCacheGroup(FULL, tuple(range(6)))]
    sw = SlidingWindowSpec(128)
    specs = [sw, sw, sw, FULL] * 2 + [sw]  # 7 sliding, 2 full
    groups = make_kv_cache_groups(specs)
    manager = KVCacheManager(groups, 8, 4)
    assert manager.group_size == 2
    assert [g.layer_ids for g in groups] == [(0, 1), (2, 4), (5, 6), (8,), (3, 7)]
    assert [g.spec for g in groups] == [sw, sw, sw, sw, FULL]
    assert manager.layer_to_group == [0, 0, 1, 4, 1, 2, 2, 4, 3]
    assert manager.layer_to_slot == [0, 1, 0, 0, 1, 0, 1, 1, 0]
    with pytest.raises(ValueError):
        make_kv_cache_groups([])


def test_allocate_fails_without_change_when_exhausted():
    manager = KVCacheManager(make_kv_cache_groups([FULL, SlidingWindowSpec(4)]), 9, 4)
    first = _request("a", list(range(16)))
    _admit(manager, first)  # full: 4 blocks, sliding: 4 blocks -> 8 of 8
    assert manager.num_free_blocks == 0 and manager.usage == 1.0
    second = _request("b", list(range(100, 108)))
    before = (manager.get_block_ids("a"), manager.num_free_blocks, manager.num_evictions)
    assert not manager.allocate_slots(second, 8)
    assert manager.get_block_ids("b") == [[], []]
    assert (manager.get_block_ids("a"), manager.num_free_blocks,
            manager.num_evictions) == before
    manager.check_integrity()
    # Decoding "a" frees out-of-window sliding blocks, which pay for the new block.
    _decode(manager, first, 1)
    assert manager.get_block_ids("a")[1][:2] == [0, 0]
    manager.free(first)
    assert manager.usage == 0.0


def test_fragmentation():
    manager = KVCacheManager(make_kv_cache_groups([FULL]), 16, 4)
    assert manager.fragmentation() == 0.0
    _admit(manager, _request("a", list(range(6))))  # 2 blocks, 6 of 8 slots used
    assert manager.fragmentation() == pytest.approx(0.25)


def test_reset_prefix_cache():
    manager = KVCacheManager(make_kv_cache_groups([FULL]), 16, 4)
    request = _request("a", list(range(9)))
    _admit(manager, request)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert _admit(manager, _request("b", list(range(9)))) == 0


def test_a_block_its_decode_steps_filled_is_cached_when_its_request_frees_it():
    """Pipelined decode: the token that fills a block is still on the device
    when the block fills. The decode paths leave such blocks to `free`
    (`_offer_deferred`): while the request runs, a new request hits its prompt
    blocks only; once it is freed (finished, aborted, preempted), all of them."""
    manager = KVCacheManager(make_kv_cache_groups([FULL] * 2), num_blocks=32, block_size=4)
    a = _request("a", [1, 2, 3, 4, 5, 6])
    _admit(manager, a)
    for token in (7, 8):  # the step for position p is scheduled before token p is known
        assert manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        a.output_token_ids.append(token)
    assert manager.allocate_slots(a, 1)  # opens block 2: block 1 ([5, 6, 7, 8]) is known now
    manager.check_integrity()
    assert manager.get_computed_blocks(_request("x", list(range(1, 10))))[1] == 4
    manager.free(a)
    manager.check_integrity()
    assert manager.get_computed_blocks(_request("b", list(range(1, 10))))[1] == 8


def test_a_block_whose_last_token_is_unknown_stays_uncached_when_freed():
    """Freed while the token that fills its tail is still on the device (an
    abort mid-step): the tail holds a token the host does not know. Freeing
    offers the blocks before it and does not trip over the unknown token."""
    manager = KVCacheManager(make_kv_cache_groups([FULL]), num_blocks=32, block_size=4)
    a = _request("a", [1, 2, 3, 4, 5, 6])
    _admit(manager, a)
    a.output_token_ids.append(7)
    assert manager.allocate_slots(a, 2)   # positions 6 and 7 scheduled; token 8 not sampled yet
    manager.free(a)
    assert manager.get_computed_blocks(_request("b", [1, 2, 3, 4, 5, 6, 7, 99, 9]))[1] == 4


def test_can_allocate_at_a_block_boundary_changes_nothing():
    """`can_allocate` is a question: at the token that would open a new block
    (the allocation's direct path) it answers without taking the block."""
    manager = KVCacheManager(make_kv_cache_groups([FULL] * 2), num_blocks=32, block_size=4)
    a = _request("a", list(range(8)))
    _admit(manager, a)
    a.output_token_ids.append(9)
    free, ids = manager.num_free_blocks, manager.get_block_ids("a")
    assert manager.can_allocate(a, 1)
    assert manager.num_free_blocks == free and manager.get_block_ids("a") == ids
    manager.check_integrity()
    assert manager.allocate_slots(a, 1) and manager.num_free_blocks == free - len(manager.managers)


def test_a_compressed_group_gets_a_block_only_where_a_window_ends():
    """A full group beside a 1/16 compressed group at 8-token blocks (no group
    drops blocks): every block opening gives the full group a block, the
    compressed one only every other slot (NULL between), as its policy says."""
    from kvserve.cache.block_pool import NULL_BLOCK_ID
    importlib.import_module("kvserve.cache.compressed_managers")  # registers the compressed policy
    from kvserve.cache.v4_specs import CompressedSpec
    groups = [KVCacheGroup(FULL, (0,)), KVCacheGroup(CompressedSpec(16, False), (1,))]
    manager = KVCacheManager(groups, num_blocks=64, block_size=8)
    a = _request("a", list(range(5)))
    _admit(manager, a)
    for token in range(40):
        _decode(manager, a, 100 + token)
    full, compressed = manager.get_block_ids("a")
    assert len(full) == len(compressed) == 6 and NULL_BLOCK_ID not in full
    assert [b != NULL_BLOCK_ID for b in compressed] == [False, True] * 3


def _decoding(manager: KVCacheManager, names: str, prompt_len: int) -> list[Request]:
    """Requests admitted with staggered prompts, their next tokens pending (pipelined decode)."""
    requests = []
    for i, name in enumerate(names):
        r = _request(name, [100 * i + t for t in range(prompt_len + i)])
        _admit(manager, r)
        r.num_pending_tokens = 1
        requests.append(r)
    return requests


def _state(manager: KVCacheManager, requests: list[Request]) -> tuple:
    for r in requests:
        manager._sync_tails(r.request_id)  # what the fast path left behind
    fill = manager._held.fill
    return ([manager.get_block_ids(r.request_id) for r in requests], dict(manager._num_tokens),
            sorted(manager.pool.cached), manager.num_free_blocks, fill.used_slots, fill.num_held)


# Two full groups (rooms of two tails each), and one that drops blocks (no rooms).
ROWS_LAYOUTS = {"full x2": [KVCacheGroup(FULL, (0,)), KVCacheGroup(FULL, (1,))],
                "full + sliding": make_kv_cache_groups([FULL, SlidingWindowSpec(6)])}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("layout", sorted(ROWS_LAYOUTS))
def test_allocate_rows_does_what_allocate_slots_does_row_by_row(layout, caching):
    """Decode steps through rooms, tails that fill, blocks that open and a pool
    that runs dry: the rows call changes the cache exactly as allocate_slots
    per row does, and stops at the row that failed."""
    managers = [KVCacheManager(ROWS_LAYOUTS[layout], num_blocks=30, block_size=4,
                               enable_prefix_caching=caching) for _ in range(2)]
    walks = [_decoding(m, "abcde", 5) for m in managers]
    stops = set()
    for step in range(12):
        rows = [(r, 1, r.num_computed_tokens) for r in walks[0]]
        done = managers[0].allocate_rows(rows)
        stops.add(done)
        expected = next((i for i, r in enumerate(walks[1]) if not managers[1].allocate_slots(r, 1)), len(rows))
        assert done == expected
        assert _state(managers[0], walks[0]) == _state(managers[1], walks[1]), step
        for walk in walks:
            for r in walk[:done]:
                r.num_computed_tokens += 1
                r.output_token_ids.append(step)
        managers[0].check_integrity()
    assert min(stops) < len(rows)  # the pool ran dry on the way


def test_allocate_rows_refuses_a_negative_count_inside_a_room():
    manager = KVCacheManager(make_kv_cache_groups([FULL]), num_blocks=8, block_size=4)
    r = _request("a", [1, 2, 3, 4, 5, 6])
    _admit(manager, r)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        manager.allocate_rows([(r, -1, r.num_computed_tokens)])
