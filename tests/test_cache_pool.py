"""Block pool: free queue, eviction accounting, cached free blocks, collisions."""
from __future__ import annotations

import pytest

from kvserve.cache import hashing
from kvserve.cache.block_pool import BlockContent, BlockPool, FreeBlockQueue, KVBlock
from kvserve.cache.groups import make_kv_cache_groups
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.hashing import block_content
from kvserve.cache.specs import FullAttentionSpec
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def _content(tokens: tuple[int, ...], index: int = 0, parent: bytes | None = None) -> BlockContent:
    return BlockContent(parent, tokens, index)


def test_free_queue_popleft_append_remove_middle():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4] and len(queue) == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4, 2, 0]
    with pytest.raises(ValueError):
        queue.remove(KVBlock(9))
    for _ in range(5):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()


def test_null_block_is_reserved():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 3
    blocks = pool.get_new_blocks(3)
    assert all(b.block_id != 0 for b in blocks)
    assert pool.usage == 1.0
    pool.free_blocks([pool.null_block])  # ignored, not a double free
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_freed_hashed_block_stays_hittable_until_reclaimed():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 0, b"ha", _content((1, 2)))
    pool.free_blocks([b, a])  # a's tail (b) first: b is evicted first
    assert pool.num_free_blocks == 2 and pool.usage == 0.0
    assert pool.get_cached_block(0, b"ha", _content((1, 2))) is a
    assert pool.get_cached_block(1, b"ha", _content((1, 2))) is None  # other group
    (first,) = pool.get_new_blocks(1)
    assert first is b and pool.num_evictions == 0  # b held no hash
    pool.touch([a])  # a hit revives the free cached block
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free_blocks([a, first])
    reclaimed = pool.get_new_blocks(2)
    assert a in reclaimed and pool.num_evictions == 1
    assert pool.get_cached_block(0, b"ha", _content((1, 2))) is None
    pool.check_integrity({blk.block_id: 1 for blk in reclaimed})


def test_double_free_raises():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError):
        pool.free_blocks([a])


def test_lookup_verifies_tokens_and_position():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 0, b"h", _content((1, 2), index=1, parent=b"p"))
    assert pool.get_cached_block(0, b"h", _content((1, 2), index=1, parent=b"p")) is a
    assert pool.get_cached_block(0, b"h", _content((1, 3), index=1, parent=b"p")) is None
    assert pool.get_cached_block(0, b"h", _content((1, 2), index=2, parent=b"p")) is None
    assert pool.get_cached_block(0, b"h", _content((1, 2), index=1, parent=b"q")) is None


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def test_constant_hash_never_returns_wrong_tokens(monkeypatch):
    monkeypatch.setattr(hashing, "hash_block", lambda parent, tokens, extra=(): b"same")
    groups = make_kv_cache_groups([FullAttentionSpec()] * 2)
    manager = KVCacheManager(groups, num_blocks=16, block_size=4)
    first = _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, first.num_tokens)
    other = _request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    _, hit = manager.get_computed_blocks(other)
    assert hit == 0  # same hash, different tokens: a miss
    same = _request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    computed, hit = manager.get_computed_blocks(same)
    # The constant hash lets only one block into the map: block 0 still hits.
    assert hit == 4 and computed.blocks[0][0].content.token_ids == (1, 2, 3, 4)
    repeated = _request("d", [1, 2, 3, 4] * 3 + [0])
    manager.free(first)
    assert manager.allocate_slots(repeated, repeated.num_tokens)
    _, hit = manager.get_computed_blocks(_request("e", [1, 2, 3, 4] * 3 + [0]))
    assert hit <= 4  # equal tokens at another position are never a hit
    manager.check_integrity()


def test_hash_block_is_chained_and_keyed():
    h0 = hashing.hash_block(None, [1, 2])
    assert h0 == hashing.hash_block(None, [1, 2])
    assert h0 != hashing.hash_block(h0, [1, 2])
    assert h0 != hashing.hash_block(None, [1, 3]) and h0 != hashing.hash_block(None, [1, 2, 0])
    request = _request("r", list(range(10)))
    hashing.extend_block_hashes(request, 4)
    assert len(request.block_hashes) == 2
    request.output_token_ids.extend([10, 11])
    hashing.extend_block_hashes(request, 4)
    assert request.block_hashes[2] == hashing.hash_block(request.block_hashes[1],
                                                         [8, 9, 10, 11])
    tokens, chain = request.all_token_ids, [None]  # every link, block 0's parent the root
    for i in range(3):
        chain.append(hashing.hash_block(chain[-1], tokens[4 * i:4 * i + 4]))
    assert request.block_hashes == chain[1:]


def test_a_cache_salt_is_block_0_s_parent():
    """vLLM's `cache_salt`: salted chains differ from the unsalted one and from another
    salt's at every block (block 0's parent is the salt's root), and equal the same salt's."""
    def chain(salt, tokens=tuple(range(12))):
        r = Request("r", list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)
        hashing.extend_block_hashes(r, 4)
        return r.block_hashes
    plain, a, b = chain(None), chain("a"), chain("b")
    assert chain("a") == a and len(a) == 3
    assert all(x != y and x != z and y != z for x, y, z in zip(plain, a, b))
    assert a[0] == hashing.hash_block(hashing.salt_root("a"), [0, 1, 2, 3]) and hashing.salt_root(None) is None
    assert a[2] == hashing.hash_block(a[1], [8, 9, 10, 11])
    # block_contents hashes the same chain (a request whose blocks are cached as they fill)
    r = Request("r", list(range(12)), SamplingParams(max_tokens=8), cache_salt="a")
    hashing.block_contents(r, 0, 3, 4)
    assert r.block_hashes == a


@pytest.mark.parametrize("hot_fraction, hits_left", [(0.5, [0, 0, 1, 1]), (0.25, [0, 0, 0, 1]),
                                                      (1.0, [1, 1, 1, 1])])
def test_hot_segment_keeps_its_share_of_the_free_blocks(hot_fraction, hits_left):
    """Freed hot leaves one by one: while the hot list holds more than
    max(1, hot_fraction x free blocks), its oldest is demoted (hit count
    spent). By hand for 0.5: after 2 blocks 2 > 1 demotes #0, after 3
    2 > 1.5 demotes #1, after 4 2 > 2 does not."""
    from kvserve.cache.block_pool import KVBlock
    from kvserve.cache.eviction import ReuseAwareQueue
    queue = ReuseAwareQueue(hot_fraction)
    blocks = [KVBlock(i + 1) for i in range(4)]
    for i, block in enumerate(blocks):
        block.block_hash, block.num_hits = bytes([i]), 1
        queue.append(block)
    assert [b.num_hits for b in blocks] == hits_left
    assert [b.block_id for b in iter(queue)] == [b.block_id for b in blocks if not b.num_hits] + \
        [b.block_id for b in blocks if b.num_hits]


def test_block_contents_are_the_lookups_contents_and_extend_the_hashes():
    """One slice serves both: the contents a lookup verifies against
    (`block_content`), and the hashes `extend_block_hashes` would append."""
    request = _request("r", list(range(10)))
    request.output_token_ids.extend([10, 11, 12])
    hashing.extend_block_hashes(request, 4)  # blocks 0-2
    hashes = list(request.block_hashes)
    request.block_hashes[:] = hashes[:1]
    contents = hashing.block_contents(request, 1, 3, 4)
    assert request.block_hashes == hashes
    assert contents == [block_content(hashes, request.all_token_ids, i, 4) for i in (1, 2)]
    with pytest.raises(ValueError, match="block 4 follows 3 hashed blocks"):
        hashing.block_contents(request, 4, 5, 4)


def _one_at_a_time(pool: BlockPool, num: int) -> list[KVBlock]:
    """`get_new_blocks` as it was: a `popleft` (and a dropped hash) per block."""
    blocks = []
    for _ in range(num):
        block = pool.free_queue.popleft()
        pool._drop_cached(block)
        block.ref_cnt = 1
        blocks.append(block)
    return blocks


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_blocks_taken_in_a_run_are_those_taken_one_at_a_time(policy):
    """Twin pools under random allocations, frees (tail first), cached blocks with
    parents and hits: `get_new_blocks`, which takes the leading uncached free
    blocks as one run (`popleft_uncached`), hands out the same blocks in the same
    order, evicts the same ones and leaves the same free queue as one pop a block."""
    import random
    from kvserve.cache.eviction import make_eviction_policy
    rng = random.Random(3)
    pools = [BlockPool(40, make_eviction_policy(policy)) for _ in range(2)]
    held: list[list[int]] = []
    runs, taken_total, pops = 0, 0, [0]
    popleft = pools[0].free_queue.popleft

    def counted_popleft():
        pops[0] += 1
        return popleft()
    pools[0].free_queue.popleft = counted_popleft
    for step in range(400):
        if held and (rng.random() < 0.45 or pools[0].num_free_blocks < 8):
            ids = held.pop(rng.randrange(len(held)))
            for pool in pools:
                pool.free_blocks([pool.blocks[i] for i in reversed(ids)])
            continue
        num = rng.randint(1, 8)
        taken = [pools[0].get_new_blocks(num), _one_at_a_time(pools[1], num)]
        assert [b.block_id for b in taken[0]] == [b.block_id for b in taken[1]], step
        runs += any(b.block_hash is None for b in taken[0])
        taken_total += num
        parent = None
        for k, block_id in enumerate(b.block_id for b in taken[0]):
            if rng.random() < 0.6:   # some blocks fill and are cached, chained to the one before
                key, hit = bytes([rng.randrange(6), k]), rng.random() < 0.3
                for pool in pools:
                    pool.cache_block(pool.blocks[block_id], 0, key, BlockContent(parent, (k,), k))
                    pool.blocks[block_id].num_hits += hit
                parent = key
        held.append([b.block_id for b in taken[0]])
        refs = {i: sum(ids.count(i) for ids in held) for ids in held for i in ids}
        for pool in pools:
            pool.check_integrity(refs)
        assert [b.block_id for b in pools[0].free_queue] == [b.block_id for b in pools[1].free_queue]
        assert pools[0].num_evictions == pools[1].num_evictions and pools[0].cached.keys() == pools[1].cached.keys()
    assert runs > 50 and pools[0].num_evictions > 20
    assert taken_total - pops[0] > 200, (pops, taken_total)   # blocks taken in runs, not one pop each
