"""Spec and group validation (errors name the limit and the value), and the
spec labels that reach /metrics through `group_blocks`."""
from __future__ import annotations

import pytest

from kvserve.cache.groups import KVCacheGroup, layer_to_group
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(window=0), "sliding window must be >= 1, got 0"),
    (dict(window=-3), "sliding window must be >= 1, got -3"),
    (dict(window=4, sink=-1), "attention sink size must be >= 0, got -1"),
])
def test_bad_specs_name_the_limit_and_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SlidingWindowSpec(**kwargs)


def test_smallest_valid_specs():
    assert SlidingWindowSpec(1).window == 1 and SlidingWindowSpec(1, sink=0).sink == 0


def test_groups_must_cover_every_layer_once():
    full = FullAttentionSpec()
    with pytest.raises(ValueError, match=r"cover layers 0..N-1 exactly once, got layers \[0, 2\]"):
        layer_to_group([KVCacheGroup(full, (0,)), KVCacheGroup(full, (2,))])
    with pytest.raises(ValueError, match="at least one layer"):
        KVCacheGroup(full, ())


def test_group_blocks_labels_and_counts():
    """A 13-token prompt in blocks of 4: 4 blocks in the full group; the
    window of 8 keeps blocks 1-3 at the query after the prompt (keys 6..13)."""
    groups = [KVCacheGroup(FullAttentionSpec(), (0,)), KVCacheGroup(SlidingWindowSpec(8, sink=0), (1,))]
    manager = KVCacheManager(groups, 32, 4)
    request = Request("a", list(range(13)), SamplingParams(max_tokens=4))
    assert manager.allocate_slots(request, 13)
    request.num_computed_tokens = 13
    request.output_token_ids.append(1)
    assert manager.allocate_slots(request, 1)
    assert manager.group_blocks() == {"g0:full": 4, "g1:sliding(window=8, sink=0)": 3}


def test_one_group_counts_held_blocks_from_the_pool_as_the_walk_would():
    """The single-group fast path equals a walk over the tables, shared and
    cached-but-free blocks included, after every step of a random walk."""
    import random
    rng = random.Random(3)
    manager = KVCacheManager([KVCacheGroup(FullAttentionSpec(), (0,))], 40, 4)
    live, shared = {}, 0
    for step in range(300):
        if live and (rng.random() < 0.4 or manager.num_free_blocks < 8):
            manager.free(live.pop(rng.choice(sorted(live))))
        else:
            tokens = [rng.randint(0, 2) for _ in range(rng.randint(2, 20))]
            request = Request(f"r{step}", tokens, SamplingParams(max_tokens=4))
            hit, _ = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, len(tokens) - hit.num_tokens, hit):
                shared += hit.num_tokens > 0
                request.num_computed_tokens = len(tokens)
                live[request.request_id] = request
        walk = KVCacheManager._distinct_held(manager.managers[0])
        assert manager.group_blocks() == {"g0:full": walk}, step
    assert shared > 20  # prefix hits: blocks held by several requests, or cached while free
