"""Reuse-aware eviction order, the copy executor on CPU, and the multi-turn
simulation behind docs/eviction.md."""
from __future__ import annotations

import torch

from kvserve.cache.block_pool import BlockContent, BlockPool
from kvserve.cache.eviction import ReuseAwareQueue
from kvserve.cache.host_tier import BlockCopy, CopyBatch
from kvserve.runner import kv_transfer
from kvserve.runner.kv_transfer import KVTransfer
from kv_pressure_sim import Workload, simulate


def _chain(pool: BlockPool, blocks, tag: bytes) -> None:
    """Cache `blocks` as one prefix chain (block i is block i-1's child)."""
    parent = None
    for index, block in enumerate(blocks):
        key = tag + bytes([index])
        pool.cache_block(block, 0, key, BlockContent(parent, (index,), index))
        parent = key


def test_reuse_policy_evicts_leaves_then_cold_before_hot():
    pool = BlockPool(8, ReuseAwareQueue(hot_fraction=1.0))
    hot, cold = pool.get_new_blocks(3), pool.get_new_blocks(3)
    _chain(pool, hot, b"h")
    _chain(pool, cold, b"c")
    # Free heads first (the worst order for LRU): hot's prefix was hit once.
    pool.free_blocks(hot + cold)
    pool.touch(hot[:2])
    pool.free_blocks(hot[:2])
    order = [block.block_id for block in pool.get_new_blocks(7)]
    # The uncached block; hot's never-hit tail (a cold leaf); the cold chain
    # leaf-first; only then the hit prefix, leaf-first.
    assert order == [7, hot[2].block_id] + [b.block_id for b in reversed(cold)] + [2, 1]
    pool.check_integrity({block_id: 1 for block_id in range(1, 8)})


def test_parent_waits_for_its_children():
    pool = BlockPool(6, ReuseAwareQueue())
    chain = pool.get_new_blocks(4)
    _chain(pool, chain, b"x")
    pool.free_blocks(chain)  # head first: LRU would evict the root first
    evicted = []
    pool.on_evict = lambda block: evicted.append((block.block_id, block.num_children))
    pool.get_new_blocks(5)
    assert [children for _, children in evicted] == [0, 0, 0, 0]
    assert [block_id for block_id, _ in evicted] == [b.block_id for b in reversed(chain)]


def test_kv_transfer_round_trip_on_cpu(monkeypatch):
    monkeypatch.setattr(kv_transfer, "HOST_CHUNK_BYTES", 3 * 2 * 2 * 4 * 2 * 8 * 4)  # 3 blocks a chunk
    storage = torch.randn(2, 2, 10, 4, 2, 8)  # [slots, K/V, blocks, block_size, heads, dim]
    caches, original = storage.unbind(0), [c.clone() for c in storage.unbind(0)]
    transfer = KVTransfer(storage, num_host_blocks=7, device=torch.device("cpu"))
    assert [c.shape[0] for c in transfer.chunks] == [3, 3, 1]
    saves = [BlockCopy(True, gpu, slot) for gpu, slot in [(1, 0), (2, 1), (3, 2), (4, 3), (5, 6), (1, 4)]]
    # Half as background write-backs, half urgent: both land.
    transfer.run(CopyBatch(copies=[BlockCopy(c.to_host, c.gpu_block, c.host_slot, background=True)
                                   for c in saves[:3]] + saves[3:]))
    for cache in caches:
        cache.zero_()
    loads = [BlockCopy(False, gpu, slot) for gpu, slot in [(9, 0), (8, 1), (7, 2), (6, 3), (5, 6), (4, 4)]]
    transfer.run(CopyBatch(copies=loads, index=1))
    for cache, before in zip(caches, original):
        for gpu, src in [(9, 1), (8, 2), (7, 3), (6, 4), (5, 5), (4, 1)]:
            assert torch.equal(cache[:, gpu], before[:, src])
    # A prefetch lands at the next forward (`wait_prefetched`), not before.
    for cache in caches:
        cache[:, 3].zero_()
    transfer.run(CopyBatch(copies=[BlockCopy(False, 3, 0)], index=2), prefetch=True)
    assert not any(cache[:, 3].any() for cache in caches)
    transfer.wait_prefetched()
    assert all(torch.equal(cache[:, 3], before[:, 1]) for cache, before in zip(caches, original))
    metrics = transfer.metrics()
    assert metrics["kv_host_blocks_to_host"] == 6 and metrics["kv_host_blocks_to_gpu"] == 7
    assert metrics["kv_host_blocks_prefetched"] == 1
    assert metrics["kv_host_bytes_to_gpu"] == 7 * transfer.block_bytes


def test_kv_transfer_moves_descending_slots_as_one_run(monkeypatch):
    # Eviction writes a prefix back tail first, into ascending slots: loading it
    # back in prefix order reads descending slots, which must still be one copy.
    storage = torch.randn(2, 2, 12, 4, 2, 8)
    original = storage.clone()
    transfer = KVTransfer(storage, num_host_blocks=8, device=torch.device("cpu"))
    runs = []
    real_runs = KVTransfer._runs

    def recorded(self, slots):
        for run in real_runs(self, slots):
            runs.append(run[3])
            yield run
    monkeypatch.setattr(KVTransfer, "_runs", recorded)
    tail_first = [4, 3, 2, 1]
    transfer.run(CopyBatch(copies=[BlockCopy(True, gpu, slot) for slot, gpu in enumerate(tail_first)]))
    storage.zero_()
    prefix_order = [BlockCopy(False, 10 - gpu, 3 - i) for i, gpu in enumerate(reversed(tail_first))]
    transfer.run(CopyBatch(copies=prefix_order, index=1))
    assert runs == [4, 4]
    for gpu in (1, 2, 3, 4):
        assert torch.equal(storage[:, :, 10 - gpu], original[:, :, gpu])


def test_simulated_multi_turn_hit_rate_reuse_beats_lru():
    work = Workload(max_running=8)
    assert simulate("reuse", 768, work) > simulate("lru", 768, work) + 0.3
    # A host tier recovers nearly every reusable token for either policy.
    assert simulate("lru", 384, work, host_blocks=2048) > 0.65
