"""V4 KV groups in the one block pool: seeded allocator random walks (>= 1,000
steps, integrity check and KV-content check after each), per-group block
bounds for long sequences, and the layout's pages."""
from __future__ import annotations

import random

import pytest

import kvserve.cache.compressed_managers  # noqa: F401 (registers the V4 managers)
import test_cache_random_walk as walk_steps
from kv_walk import SlotContents
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.v4_specs import CompressedSpec, v4_kv_layout
from kvserve.model.deepseek_v4.loader import dummy_config
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

STEPS = 1000


def v4_write_and_read(manager: KVCacheManager, kv: SlotContents, request: Request, start: int, end: int) -> None:
    """Like kv_walk.write_and_read, except that a compressed group writes (and
    later reads) only at window ends, the positions where an entry is made."""
    tokens, bs = request.all_token_ids, manager.block_size
    for group, ids in zip(manager.managers, manager.get_block_ids(request.request_id)):
        spec = group.spec
        entry = isinstance(spec, CompressedSpec)
        written = [p for p in range(start, end) if not entry or (p + 1) % spec.rate == 0]
        for pos in written:
            block = manager.pool.blocks[ids[pos // bs]]
            assert not block.is_null and block.ref_cnt == 1, "writing into a shared/NULL block"
            kv[(block.block_id, pos % bs)] = tuple(tokens[:pos + 1])
        needed = (range(spec.rate - 1, end, spec.rate) if entry
                  else set(range(spec.visible_start(start), end)) | set(range(min(spec.sink, end))))
        for key in needed:
            assert ids[key // bs] != 0, f"key {key} needed but NULL in {spec.describe()}"
            assert kv.get((ids[key // bs], key % bs)) == tuple(tokens[:key + 1]), \
                f"wrong KV for key {key} of {request.request_id} in {spec.describe()}"


def _manager(block_size: int, caching: bool, num_blocks: int, policy: str = "reuse") -> KVCacheManager:
    # tiny V4: CSA (rate 4, overlap state window 8), HCA (rate 128), sliding window 8
    layout = v4_kv_layout(dummy_config("tiny-deepseek-v4"), block_size)
    return KVCacheManager(layout.kv_groups(), num_blocks, block_size, enable_prefix_caching=caching,
                          eviction_policy=policy)


@pytest.mark.parametrize("block_size, caching, policy", [(4, True, "reuse"), (8, True, "lru"), (16, False, "reuse")])
def test_random_walk_with_v4_groups(monkeypatch, block_size, caching, policy):
    monkeypatch.setattr(walk_steps, "write_and_read", v4_write_and_read)
    num_blocks = 5 * 200 // block_size + 8
    manager = _manager(block_size, caching, num_blocks, policy)
    rng = random.Random(block_size)
    prefixes = [[rng.randrange(50) for _ in range(60)] for _ in range(3)]
    walk = walk_steps.Walk(manager, rng, prefixes, max_tokens=walk_steps.MAX_TOKENS, vocab=50)
    for _ in range(STEPS):
        walk_steps.random_step(walk)
        manager.check_integrity()
    for request in list(walk.running.values()):
        manager.free(request)
    manager.check_integrity()
    assert manager.usage == 0.0 and manager.num_free_blocks == num_blocks - 1
    assert (walk.num_hits > 0) == caching


@pytest.mark.parametrize("block_size", [4, 8, 16, 32])
def test_blocks_per_sequence_stay_within_each_groups_rate(block_size):
    """Decode a 3,000-token sequence one token at a time (after an 8-token chunk
    split): sliding and state groups hold a window's blocks, compressed groups
    one block per max(block_size, rate) tokens."""
    manager = _manager(block_size, True, 4000)
    request = Request("long", list(range(3000)), SamplingParams(max_tokens=1))
    computed, _ = manager.get_computed_blocks(request)
    position = 0
    while position < 3000:
        step = 8 if position < 64 else 1
        assert manager.allocate_slots(request, step, computed if position == 0 else None)
        position += step
        request.num_computed_tokens = position
        for group, table in zip(manager.managers, manager.get_block_ids("long")):
            real = sum(1 for b in table if b)
            spec = group.spec
            if isinstance(spec, CompressedSpec):
                assert real <= -(-position // max(block_size, spec.rate))
            else:
                assert real <= -(-(spec.window - 1 + step) // block_size) + 1
    manager.check_integrity()


def test_layout_pages_fit_one_unit_and_cover_every_layer():
    config = dummy_config("deepseek-v4-flash")
    layout = v4_kv_layout(config, 16)
    for group in layout.groups:
        assert len(group.group.layer_ids) * group.kind.layer_page <= layout.unit
    for kind, layers in (("sliding", range(43)), ("csa_entries", [i for i, t in enumerate(config.layer_types)
                                                                   if t.startswith("compressed")])):
        covered = sorted(l for g in layout.groups if g.kind.name == kind for l in g.group.layer_ids)
        assert covered == list(layers)
    with pytest.raises(ValueError, match="multiple of the CSA rate 4, got 6"):
        v4_kv_layout(config, 6)
