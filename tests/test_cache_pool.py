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
