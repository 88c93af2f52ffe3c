"""Per-attention-type block policy: one manager per KV cache group.

A manager owns, per request, the block table of ONE group (a list of
`KVBlock`, the NULL block where this attention type will never read again)
and decides: how many blocks cover N tokens, which blocks can be dropped as a
window moves, and what the longest prefix-cache hit is. Physical blocks come
from the shared `BlockPool`. A new attention type adds a spec in `specs.py`
and a manager here, registered in `MANAGER_FOR_SPEC`.
"""
from __future__ import annotations

import abc

from collections.abc import Sequence

from kvserve.cache.block_pool import NULL_BLOCK_ID, BlockContent, BlockPool, KVBlock
from kvserve.cache.hashing import block_content
from kvserve.cache.host_tier import HostBlockRef, HostTier
from kvserve.cache.specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec

# A hit block: on the GPU, or in the host tier (loaded on admission).
HitBlock = KVBlock | HostBlockRef


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeManager(abc.ABC):
    """Shared bookkeeping; subclasses supply the attention-type policy."""

    # Whether this type frees blocks as queries move on (sliding windows do).
    drops_blocks = True

    def __init__(self, spec: AttentionSpec, pool: BlockPool, block_size: int,
                 group_id: int, host_tier: HostTier | None = None) -> None:
        self.spec = spec
        self.pool = pool
        self.host_tier = host_tier
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # Leading blocks of each table already offered to the hash map.
        self.num_cached_blocks: dict[str, int] = {}

    # ---- policy hooks -------------------------------------------------
    @abc.abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], token_ids: Sequence[int],
                               max_length: int) -> list[HitBlock]:
        """Hit blocks (NULL where not needed) of the longest valid hit <= max_length."""

    def skippable_blocks(self, request_id: str, first_query_pos: int) -> list[int]:
        """Table indices this type will never read again once queries start at
        `first_query_pos`; highest index first (the eviction order we free in)."""
        return []

    def max_blocks(self, num_tokens: int, chunk_tokens: int = 1) -> int:
        """Peak blocks one request holds in this group to reach `num_tokens`."""
        return cdiv(num_tokens, self.block_size)

    # ---- mechanics ----------------------------------------------------
    def blocks(self, request_id: str) -> list[KVBlock]:
        return self.req_to_blocks.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        held = len(self.req_to_blocks.get(request_id, ())) + num_hit_blocks  # not blocks(), cdiv(): asked per block opened
        return max(0, -(-num_tokens // self.block_size) - held)

    def num_reclaimed(self, request_id: str, first_query_pos: int) -> int:
        """Blocks that become free when the skippable ones are dropped."""
        table = self.blocks(request_id)
        return sum(1 for i in self.skippable_blocks(request_id, first_query_pos)
                   if table[i].ref_cnt == 1)

    def add_hit_blocks(self, request_id: str, hit_blocks: Sequence[KVBlock],
                       count_hit: bool = True) -> None:
        if request_id in self.req_to_blocks:
            raise ValueError(f"request {request_id!r} already holds blocks; prefix hits "
                             f"apply only to a request being admitted")
        self.pool.touch(hit_blocks, count_hit)
        self.req_to_blocks[request_id] = list(hit_blocks)
        self.num_cached_blocks[request_id] = len(hit_blocks)

    def remove_skipped_blocks(self, request_id: str, first_query_pos: int) -> None:
        table = self.blocks(request_id)
        skipped = self.skippable_blocks(request_id, first_query_pos)
        freed = [table[i] for i in skipped]
        for i in skipped:
            table[i] = self.pool.null_block
        self.pool.free_blocks(freed)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        table = self.req_to_blocks.setdefault(request_id, [])
        table.extend(self.pool.get_new_blocks(self.num_new_blocks(request_id, num_tokens, 0)))

    def num_opening_one_block(self, request_ids: list[str], totals: list[int]) -> int:
        """How many leading requests need exactly one new block to cover
        `totals[k]` tokens (`num_new_blocks(request_ids[k], totals[k], 0) == 1`)."""
        for n, (request_id, total) in enumerate(zip(request_ids, totals)):
            if self.num_new_blocks(request_id, total, 0) != 1:
                return n
        return len(request_ids)

    def append_blocks(self, request_ids: list[str], blocks: list[KVBlock]) -> None:
        """A fresh block from the pool at the end of each request's table, blocks[k]
        at request_ids[k]'s (it holds one)."""
        for table, block in zip(map(self.req_to_blocks.__getitem__, request_ids), blocks):
            table.append(block)

    def cache_full_blocks(self, request_id: str, block_hashes: Sequence[bytes],
                          contents: Sequence[BlockContent], first: int) -> None:
        """Register the blocks not offered to the hash map yet among blocks
        [first, first + len(contents)), full of known tokens (`contents[i]`:
        what block first + i holds). NULL entries (a window's dropped blocks, a
        compressed group's slots where no window ends) hold nothing to cache."""
        table = self.req_to_blocks.get(request_id, ())
        start = self.num_cached_blocks.get(request_id, 0)
        if start < first:
            raise ValueError(f"blocks [{start}, {first}) of {request_id!r} have no contents to cache")
        end = min(first + len(contents), len(table))
        for index in range(start, end):
            block = table[index]
            if block.block_id != NULL_BLOCK_ID:  # not block.is_null: once per block cached
                self.pool.cache_block(block, self.group_id, block_hashes[index], contents[index - first])
        self.num_cached_blocks[request_id] = max(start, end)

    def free(self, request_id: str) -> None:
        """Free the table tail first so the shared prefix outlives it in the cache."""
        table = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed(table))

    def lookup(self, block_hashes: Sequence[bytes], token_ids: Sequence[int],
               index: int) -> HitBlock | None:
        """The verified cached block: on the GPU if there, else in the host tier."""
        content = block_content(block_hashes, token_ids, index, self.block_size)
        block = self.pool.get_cached_block(self.group_id, block_hashes[index], content)
        if block is None and self.host_tier is not None:
            return self.host_tier.lookup((self.group_id, block_hashes[index]), content)
        return block


class FullAttentionManager(SingleTypeManager):
    """Every key stays visible: keep all blocks; hits are prefix-closed."""

    drops_blocks = False

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], token_ids: Sequence[int],
                               max_length: int) -> list[HitBlock]:
        hit: list[HitBlock] = []
        for index in range(min(max_length // self.block_size, len(block_hashes))):
            block = self.lookup(block_hashes, token_ids, index)
            if block is None:
                break
            hit.append(block)
        return hit


class SlidingWindowManager(SingleTypeManager):
    """Window + sink: blocks between the sink and the window go back to the pool.

    A query at p sees key k iff k <= p and (p - k < window or k < sink).
    """

    drops_blocks = True

    spec: SlidingWindowSpec

    @property
    def num_sink_blocks(self) -> int:
        return cdiv(self.spec.sink, self.block_size)

    def skippable_blocks(self, request_id: str, first_query_pos: int) -> list[int]:
        table = self.blocks(request_id)
        # Blocks [0, end) lie wholly before the first key any query of this step sees.
        end = min(self.spec.visible_start(first_query_pos) // self.block_size, len(table))
        skipped = []
        # Outside the sink a table is NULL* then real*, so stop at the first NULL.
        for index in range(end - 1, self.num_sink_blocks - 1, -1):
            if table[index].is_null:
                break
            skipped.append(index)
        return skipped

    def max_blocks(self, num_tokens: int, chunk_tokens: int = 1) -> int:
        # Keys [p0 - window + 1, p0 + chunk) span L = window - 1 + chunk tokens;
        # L tokens straddle at most cdiv(L - 1, block_size) + 1 blocks (exact:
        # some p0 reaches it), so admission refuses no request that fits.
        bounded = (cdiv(self.spec.window - 2 + chunk_tokens, self.block_size) + 1
                   + self.num_sink_blocks)
        return min(cdiv(num_tokens, self.block_size), bounded)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], token_ids: Sequence[int],
                               max_length: int) -> list[HitBlock]:
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        found = [self.lookup(block_hashes, token_ids, i) for i in range(num_blocks)]
        for length_blocks in range(num_blocks, 0, -1):
            if self._is_valid_hit(found, length_blocks):
                return self._hit_table(found, length_blocks)
        return []

    def _is_valid_hit(self, found: list[HitBlock | None], length_blocks: int) -> bool:
        """Valid iff every block a query at L may read is cached (L = length in tokens).

        Generous by one token: the window is taken as [L - window, L).
        """
        length = length_blocks * self.block_size
        first = max(0, length - self.spec.window) // self.block_size
        sink_end = min(self.num_sink_blocks, length_blocks)
        return (all(b is not None for b in found[first:length_blocks])
                and all(b is not None for b in found[:sink_end]))

    def _hit_table(self, found: list[HitBlock | None], length_blocks: int) -> list[HitBlock]:
        """Keep only the blocks the next query (at L) reads; NULL elsewhere."""
        length = length_blocks * self.block_size
        first_needed = self.spec.visible_start(length) // self.block_size
        null = self.pool.null_block
        return [found[i] if (i >= first_needed or i < self.num_sink_blocks) else null
                for i in range(length_blocks)]


MANAGER_FOR_SPEC: dict[type, type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def make_manager(spec: AttentionSpec, pool: BlockPool, block_size: int,
                 group_id: int, host_tier: HostTier | None = None) -> SingleTypeManager:
    manager_cls = MANAGER_FOR_SPEC.get(type(spec))
    if manager_cls is None:
        raise ValueError(f"no KV cache manager for attention spec {spec!r}; "
                         f"register one in MANAGER_FOR_SPEC")
    return manager_cls(spec, pool, block_size, group_id, host_tier)
