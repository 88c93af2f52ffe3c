"""GPU eviction policies: which free block the pool reclaims next.

`lru` is the pool's `FreeBlockQueue`: least recently freed first. `reuse`
(`ReuseAwareQueue`) ranks free blocks in four O(1) intrusive lists, evicted
in this order:

  1. uncached: no hash, nothing is lost;
  2. cold leaves: cached, no cached children, never hit since cached
     (one-shot tails: generated text, a prompt's unshared suffix);
  3. hot leaves: cached, no cached children, hit at least once;
  4. inner blocks: cached blocks with cached children, the fallback only
     when every leaf is gone (their children are then held by requests).

A parent is never evicted while a free cached child could go instead, since
that would strand the child. Each list is LRU by the time a block entered it.
The hot list is a protected segment in the SLRU sense: when it grows past
`hot_fraction` of the free blocks, its oldest block is demoted to the cold
list (its hit count spent), so prefixes that were popular once do not stay
forever. Measurements behind the choice: docs/eviction.md.
"""
from __future__ import annotations

from collections.abc import Iterator

from kvserve.cache.block_pool import EvictionPolicy, FreeBlockQueue, KVBlock
from kvserve.config import EVICTION_POLICIES

DEFAULT_HOT_FRACTION = 0.5


class ReuseAwareQueue:
    """Leaves first, never-hit before hit, LRU within each class; all O(1)."""

    def __init__(self, hot_fraction: float = DEFAULT_HOT_FRACTION) -> None:
        if not 0.0 <= hot_fraction <= 1.0:
            raise ValueError(f"hot_fraction must be in [0, 1], got {hot_fraction}")
        self.hot_fraction = hot_fraction
        self._uncached = FreeBlockQueue()
        self._cold = FreeBlockQueue()
        self._hot = FreeBlockQueue()
        self._inner = FreeBlockQueue()
        self._order = (self._uncached, self._cold, self._hot, self._inner)
        self._len = 0  # over all four lists: read on every allocation

    def _target(self, block: KVBlock) -> FreeBlockQueue:
        if block.block_hash is None:
            return self._uncached
        if block.num_children > 0:
            return self._inner
        return self._hot if block.num_hits > 0 else self._cold

    def append(self, block: KVBlock) -> None:
        queue = self._target(block)
        queue.append(block)
        block.free_list = queue
        self._len += 1
        if queue is self._hot:
            self._demote_overflow()

    def extend(self, blocks: list[KVBlock]) -> None:
        """`append` of each block in order (a freed request's blocks): runs of
        blocks bound for the same list linked at once (`FreeBlockQueue.extend`);
        a hot block through `append`, which may demote. `_target` inlined: once
        per block a finished request frees."""
        run: list[KVBlock] = []
        queue = None
        for block in blocks:
            if block.block_hash is None:
                target = self._uncached
            elif block.num_children > 0:
                target = self._inner
            elif block.num_hits > 0:
                self._link(queue, run)
                run, queue = [], None
                self.append(block)
                continue
            else:
                target = self._cold
            if target is not queue:
                self._link(queue, run)
                run, queue = [], target
            run.append(block)
            block.free_list = target
        self._link(queue, run)

    def _link(self, queue: FreeBlockQueue | None, run: list[KVBlock]) -> None:
        if run:
            queue.extend(run)
            self._len += len(run)

    def remove(self, block: KVBlock) -> None:
        queue = block.free_list
        if not isinstance(queue, FreeBlockQueue):
            raise ValueError(f"{block} is not in the free queue")
        queue.remove(block)
        block.free_list = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        for queue in self._order:
            if queue._len:  # not len(queue): a Python call per list, once per block allocated
                block = queue.popleft()
                block.free_list = None
                self._len -= 1
                return block
        raise ValueError("no free blocks left")

    def popleft_uncached(self, limit: int) -> list[KVBlock]:
        """`popleft` up to `limit` times while it pops from the uncached list
        (the first it pops from; its blocks hold no hash)."""
        blocks = self._uncached.popleft_uncached(limit)
        for block in blocks:
            block.free_list = None
        self._len -= len(blocks)
        return blocks

    def update(self, block: KVBlock) -> None:
        if block.free_list is not self._target(block):
            self.remove(block)
            self.append(block)

    def _demote_overflow(self) -> None:
        while len(self._hot) > max(1.0, self.hot_fraction * len(self)):
            block = self._hot.popleft()
            block.num_hits = 0
            self._cold.append(block)
            block.free_list = self._cold

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        for queue in self._order:
            yield from queue

    def check_integrity(self) -> None:
        if self._len != sum(queue._len for queue in self._order):
            raise RuntimeError(f"the eviction lists hold {sum(q._len for q in self._order)} blocks, "
                               f"their total says {self._len}")
        for queue in self._order:
            for block in queue:
                if block.free_list is not queue or self._target(block) is not queue:
                    raise RuntimeError(f"{block} sits in the wrong eviction list")


def make_eviction_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return FreeBlockQueue()
    if name == "reuse":
        return ReuseAwareQueue()
    raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {name!r}")
