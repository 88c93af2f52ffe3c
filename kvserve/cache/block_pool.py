"""The physical KV block pool: ref counts, the free queue, the prefix hash map.

Owns every `KVBlock` and nothing about attention types or requests. Policy
(which blocks a request needs) lives in `managers.py`; the pool only hands
out, shares, frees and caches blocks.

Free blocks keep their hash and stay hittable until they are reclaimed for new
data; reclaiming one counts as an eviction. Which free block is reclaimed next
is decided by an `EvictionPolicy` (plain LRU: `FreeBlockQueue`; reuse-aware:
`cache/eviction.py`). The pool keeps what such a policy needs in O(1): each
cached block's hit count and its number of cached children (blocks whose
parent hash is its hash). `on_evict`, when set, sees a cached block just
before its hash is dropped (the host tier copies it out then).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, Protocol

NULL_BLOCK_ID = 0


class BlockContent(NamedTuple):
    """What a cached block holds, kept so a hit is verified exactly.

    The block index is part of it because equal tokens at another position
    produce different KV (rotary embeddings), even with an equal parent hash.
    A named tuple, not a frozen dataclass: one is built per block cached (every
    block_size decode steps of every request) and per block looked up, and a
    frozen dataclass's __init__ costs three object.__setattr__ calls.
    """

    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_index: int


class KVBlock:
    """One physical block: `block_size` KV slots in every layer of a group slot."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "cache_group", "content",
                 "prev_free", "next_free", "num_hits", "num_children", "free_list")
    # A GPU block; `HostBlockRef` (cache/host_tier.py) says True.
    on_host = False

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is in the hash map under (cache_group, block_hash).
        self.block_hash: bytes | None = None
        self.cache_group: int | None = None
        self.content: BlockContent | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        # Eviction hints, valid while cached: prefix hits since cached, and
        # cached blocks whose parent hash is this block's hash.
        self.num_hits = 0
        self.num_children = 0
        # The eviction policy's list this free block sits in (policy-owned).
        self.free_list: object | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, {cached})"


class EvictionPolicy(Protocol):
    """Orders free blocks for reclaiming; the first popped is evicted first."""

    def append(self, block: KVBlock) -> None: ...
    def extend(self, blocks: list[KVBlock]) -> None:
        """`append` of each block in order."""
    def remove(self, block: KVBlock) -> None: ...
    def popleft(self) -> KVBlock: ...
    def popleft_uncached(self, limit: int) -> list[KVBlock]:
        """`popleft` up to `limit` times while the block it pops holds no hash."""
    def update(self, block: KVBlock) -> None:
        """A free block's hash, hit count or child count changed."""
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[KVBlock]: ...


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) popleft/append/remove.

    LRU order: blocks are appended when freed and reclaimed from the head.
    Links live in the blocks themselves so removing a block hit by a prefix
    lookup from the middle needs no search.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)  # sentinels: no None checks at the ends
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self._len += 1

    def extend(self, blocks: list[KVBlock]) -> None:
        """`append` of each block in order, linked in one loop (a freed
        request's blocks: no call a block)."""
        tail = self._tail
        last = tail.prev_free
        for block in blocks:
            last.next_free, block.prev_free = block, last
            last = block
        last.next_free, tail.prev_free = tail, last
        self._len += len(blocks)

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        if self._len == 0:
            raise ValueError("no free blocks left")
        block = self._head.next_free  # `remove` inlined: one pop per block allocated
        following = block.next_free
        self._head.next_free, following.prev_free = following, self._head
        block.prev_free = block.next_free = None
        self._len -= 1
        return block

    def popleft_uncached(self, limit: int) -> list[KVBlock]:
        """`popleft` up to `limit` times while the head block holds no hash,
        unlinked as one run (a decode step's block openings: no call a block)."""
        blocks, block = [], self._head.next_free
        while len(blocks) < limit and block is not self._tail and block.block_hash is None:
            blocks.append(block)
            block = block.next_free
        if blocks:
            self._head.next_free, block.prev_free = block, self._head
            for taken in blocks:
                taken.prev_free = taken.next_free = None
            self._len -= len(blocks)
        return blocks

    def update(self, block: KVBlock) -> None:
        """LRU ignores hits and children: order is free time only."""

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns `num_blocks` blocks; block 0 is the reserved NULL block.

    The NULL block stands in block tables for positions an attention type will
    never read again; it is never allocated, freed or cached.
    """

    def __init__(self, num_blocks: int, free_queue: EvictionPolicy | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue: EvictionPolicy = free_queue if free_queue is not None else FreeBlockQueue()
        for block in self.blocks[1:]:
            self.free_queue.append(block)
        self.cached: dict[tuple[int, bytes], KVBlock] = {}
        # (group, hash) -> cached blocks whose parent is that key, whether or
        # not the parent itself is cached now (it may be cached again later).
        self._num_children: dict[tuple[int, bytes], int] = {}
        self.on_evict: Callable[[KVBlock], None] | None = None
        # Called when a cached block's last reference goes (it became evictable).
        self.on_free_cached: Callable[[KVBlock], None] | None = None
        self.num_evictions = 0
        # Bumped whenever cached content may have vanished (eviction, reset);
        # lets callers cheaply tell whether an earlier lookup is still valid.
        self.epoch = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of non-null blocks referenced by at least one request."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, num: int) -> list[KVBlock]:
        """Reclaim `num` free blocks (evicting their cached content) with ref 1."""
        if num > len(self.free_queue):
            raise ValueError(f"asked for {num} blocks, only {self.num_free_blocks} free")
        blocks = self.free_queue.popleft_uncached(num)   # no hash to drop: taken at once
        for block in blocks:
            block.ref_cnt = 1
        for _ in range(num - len(blocks)):
            # One at a time: dropping a hash updates the parent's place in the
            # free queue, so no popped block may still look free (ref 0) then.
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # the check inlined: most reclaimed blocks are uncached
                self._drop_cached(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock], count_hit: bool = True) -> None:
        """Add a reference (a prefix hit); a free block leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            block.num_hits += count_hit

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching 0 join the queue in the given order,
        so pass the ones to evict first first (a request's tail before its head)."""
        freed = []
        for block in blocks:   # once a freed request's block
            if block.block_id == NULL_BLOCK_ID:   # not block.is_null: a property call a block
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_queue.extend(freed)
        if self.on_free_cached is not None:
            for block in freed:
                if block.block_hash is not None:
                    self.on_free_cached(block)

    def get_cached_block(self, group_id: int, block_hash: bytes,
                         content: BlockContent) -> KVBlock | None:
        """The block cached under (group, hash) if it really holds `content`."""
        block = self.cached.get((group_id, block_hash))
        if block is None or block.content != content:
            return None
        return block

    def cache_block(self, block: KVBlock, group_id: int, block_hash: bytes,
                    content: BlockContent) -> None:
        """Make a full block hittable. The first block cached under a key keeps it:
        a duplicate (or a colliding hash) simply stays uncached."""
        if block.block_id == NULL_BLOCK_ID or block.block_hash is not None:
            return
        key = (group_id, block_hash)
        if key in self.cached:
            return
        self.cached[key] = block
        block.block_hash, block.cache_group, block.content = block_hash, group_id, content
        block.num_children = self._num_children.get(key, 0)
        if content.parent_hash is not None:
            self._add_child((group_id, content.parent_hash), +1)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached.values():
            block.block_hash = block.cache_group = block.content = None
            block.num_hits = block.num_children = 0
            self.free_queue.update(block)
        self.cached.clear()
        self._num_children.clear()
        self.epoch += 1
        return True

    def _drop_cached(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        group_id, content = block.cache_group, block.content
        del self.cached[(group_id, block.block_hash)]
        block.block_hash = block.cache_group = block.content = None
        block.num_hits = block.num_children = 0
        if content.parent_hash is not None:
            self._add_child((group_id, content.parent_hash), -1)
        self.num_evictions += 1
        self.epoch += 1

    def _add_child(self, parent_key: tuple[int, bytes], delta: int) -> None:
        count = self._num_children.get(parent_key, 0) + delta
        if count:
            self._num_children[parent_key] = count
        else:
            self._num_children.pop(parent_key, None)
        parent = self.cached.get(parent_key)
        if parent is not None:
            parent.num_children = count
            if parent.ref_cnt == 0:
                self.free_queue.update(parent)

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """Raise RuntimeError if ref counts, free queue or hash map disagree.

        `expected_refs[block_id]` is how many block tables reference the block.
        """
        self._check_free_queue()
        for block in self.blocks[1:]:
            expected = expected_refs.get(block.block_id, 0)
            if block.ref_cnt != expected:
                raise RuntimeError(f"{block}: ref_cnt {block.ref_cnt} but "
                                   f"{expected} block tables reference it")
        for (group_id, block_hash), block in self.cached.items():
            if block.block_hash != block_hash or block.cache_group != group_id:
                raise RuntimeError(f"hash map entry for group {group_id} points to {block} "
                                   f"whose hash/group differ")
        self._check_children()
        check = getattr(self.free_queue, "check_integrity", None)
        if check is not None:
            check()

    def _check_children(self) -> None:
        counts: dict[tuple[int, bytes], int] = {}
        for (group_id, _), block in self.cached.items():
            if block.content.parent_hash is not None:
                key = (group_id, block.content.parent_hash)
                counts[key] = counts.get(key, 0) + 1
        if counts != self._num_children:
            raise RuntimeError("cached child counts disagree with the hash map")
        for key, block in self.cached.items():
            if block.num_children != counts.get(key, 0):
                raise RuntimeError(f"{block} counts {block.num_children} cached children, "
                                   f"the hash map says {counts.get(key, 0)}")

    def _check_free_queue(self) -> None:
        seen: set[int] = set()
        for block in self.free_queue:
            if block.is_null:
                raise RuntimeError("the NULL block is in the free queue")
            if block.block_id in seen:
                raise RuntimeError(f"{block} is in the free queue twice")
            if block.ref_cnt != 0:
                raise RuntimeError(f"{block} has ref_cnt > 0 but is in the free queue")
            seen.add(block.block_id)
        if len(seen) != self.num_free_blocks:
            raise RuntimeError(f"free queue holds {len(seen)} blocks, "
                               f"num_free_blocks says {self.num_free_blocks}")
        for block in self.blocks[1:]:
            if block.ref_cnt == 0 and block.block_id not in seen:
                raise RuntimeError(f"{block} has ref_cnt 0 but is not in the free queue")
