"""Paged KV cache: block pool, chained prefix hashes, per-attention-type
managers and the `KVCacheManager` the scheduler talks to."""
from kvserve.cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvserve.cache.groups import KVCacheGroup, make_kv_cache_groups
from kvserve.cache.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvserve.cache.specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec

__all__ = [
    "AttentionSpec", "BlockPool", "ComputedBlocks", "FreeBlockQueue", "FullAttentionSpec",
    "KVBlock", "KVCacheGroup", "KVCacheManager", "SlidingWindowSpec", "make_kv_cache_groups",
]
