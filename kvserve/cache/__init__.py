"""Paged KV cache: block pool, chained prefix hashes, per-attention-type
managers and the `KVCacheManager` the scheduler talks to."""
from kvserve.cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvserve.cache.eviction import ReuseAwareQueue, make_eviction_policy
from kvserve.cache.host_tier import BlockCopy, HostBlockRef, HostTier
from kvserve.cache.groups import KVCacheGroup, make_kv_cache_groups
from kvserve.cache.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvserve.cache.specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec

__all__ = [
    "AttentionSpec", "BlockCopy", "BlockPool", "ComputedBlocks", "FreeBlockQueue", "FullAttentionSpec",
    "HostBlockRef", "HostTier", "KVBlock", "KVCacheGroup", "KVCacheManager", "ReuseAwareQueue",
    "SlidingWindowSpec", "make_eviction_policy", "make_kv_cache_groups",
]
