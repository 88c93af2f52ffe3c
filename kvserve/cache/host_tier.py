"""The host-memory KV tier: slot bookkeeping, its hash map and LRU, and the
queue of block copies the runner must execute.

Owns `num_blocks` host slots (the tensors live in `runner/kv_transfer.py`)
and nothing on the GPU. A slot holds either
  - a cached block, under the same (group, hash) key and verified content as
    the GPU hash map, evictable in LRU order; or
  - a private block of a swapped-out request, until it is swapped back in.

Every change of slot content is a `BlockCopy`, queued in the order the cache
logic decided it and handed to the runner in a `CopyBatch` per step. Urgent
copies (loads, saves of evicted blocks, swap-outs) run in that order and the
next forward waits for them, so it never reads a load early nor overwrites a
block before it is saved. Write-backs (`background`) are different: a cached
block that became free (its last request let go) is copied to the host right
away, on a second stream, after the batch's urgent copies, and nothing waits
for it; when the GPU later evicts the block it is already on the host (no
copy, no wait). A write-back conflicts with a later copy or forward only
through its GPU block or its host slot, and each such case sets `fence`, the
latest batch whose write-backs must land first:
  - its GPU block is evicted (the new owner, or a load, overwrites it; and
    only after this can a lookup hit the host copy and load from its slot);
  - its host entry is evicted (the slot is reused);
  - the tier is reset (both).
A fence on the batch being queued makes the runner execute that batch in
queue order on one stream instead.
Slots being loaded are pinned while GPU blocks are reclaimed for them, so the
saves those reclaims trigger cannot take them.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar

from kvserve.cache.block_pool import BlockContent, KVBlock

CacheKey = tuple[int, bytes]


@dataclass(frozen=True)
class BlockCopy:
    """Copy one block between GPU block `gpu_block` and host slot `host_slot`;
    `background`: a write-back nothing waits for (see the module doc)."""

    to_host: bool
    gpu_block: int
    host_slot: int
    background: bool = False


@dataclass
class CopyBatch:
    """One step's copies in queue order. `index` numbers batches; `fence` is
    the latest batch whose write-backs must land before this batch's urgent
    copies and the next forward (-1: none)."""

    copies: list[BlockCopy] = field(default_factory=list)
    fence: int = -1
    index: int = 0

    def __bool__(self) -> bool:
        return bool(self.copies) or self.fence >= 0


@dataclass(frozen=True)
class HostBlockRef:
    """A block of a hit (or of a swapped request) that lives in a host slot.

    It stands in `ComputedBlocks` where a `KVBlock` would; admission replaces
    it with a fresh GPU block and queues the load.
    """

    slot: int
    key: CacheKey | None          # None: a private slot of a swapped-out request
    content: BlockContent | None
    num_hits: int = field(default=0, compare=False)
    on_host: ClassVar[bool] = True
    is_null: ClassVar[bool] = False


@dataclass
class HostEntry:
    slot: int
    content: BlockContent
    num_hits: int


class HostTier:
    """Host slots: an LRU hash map of cached blocks plus private swap slots."""

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...
        self._entries: OrderedDict[CacheKey, HostEntry] = OrderedDict()  # LRU first
        self._pinned: dict[CacheKey, HostEntry] = {}
        self._private: set[int] = set()
        self.pending: list[BlockCopy] = []
        self.batch = 0              # index of the CopyBatch being queued
        self.fence = -1
        # Cached entries filled by a write-back: key -> its batch.
        self._written_back: dict[CacheKey, int] = {}
        # Bumped when a cached entry vanishes, so a stale hit is re-verified.
        self.epoch = 0
        self.num_write_backs = 0    # freed cached blocks copied out in the background
        self.num_saves = 0          # GPU blocks copied out on eviction
        self.num_save_dedups = 0    # evicted blocks already on host: no copy
        self.num_loads = 0          # blocks queued host -> GPU
        self.num_swap_out_blocks = 0
        self.num_evictions = 0

    # ---- lookups ------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._entries) + len(self._pinned)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free_slots) / self.num_blocks

    def lookup(self, key: CacheKey, content: BlockContent) -> HostBlockRef | None:
        entry = self._entries.get(key) or self._pinned.get(key)
        if entry is None or entry.content != content:
            return None
        return HostBlockRef(entry.slot, key, entry.content, entry.num_hits)

    # ---- GPU -> host --------------------------------------------------
    def save(self, block: KVBlock) -> None:
        """Keep an evicted GPU block's content (the pool's `on_evict` hook)."""
        key = (block.cache_group, block.block_hash)
        entry = self._entries.get(key) or self._pinned.get(key)
        if entry is not None:
            if entry.content == block.content and key in self._entries:
                self._entries.move_to_end(key)
                entry.num_hits = max(entry.num_hits, block.num_hits)
            self.num_save_dedups += 1
            self._fence_on(key)  # the block's new owner must not overwrite it mid-copy
            return
        slot = self._take_slot()
        if slot is None:
            return  # host full of pinned/private slots: the block is dropped
        self._entries[key] = HostEntry(slot, block.content, block.num_hits)
        self.pending.append(BlockCopy(True, block.block_id, slot))
        self.num_saves += 1

    def write_back(self, block: KVBlock) -> None:
        """Copy a cached block that just became free to the host in the
        background (the pool's `on_free_cached` hook)."""
        key = (block.cache_group, block.block_hash)
        if key in self._entries or key in self._pinned:
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._entries[key] = HostEntry(slot, block.content, block.num_hits)
        self.pending.append(BlockCopy(True, block.block_id, slot, background=True))
        self._written_back[key] = self.batch
        self.num_write_backs += 1

    def _fence_on(self, key: CacheKey) -> None:
        batch = self._written_back.get(key)
        if batch is not None:
            self.fence = max(self.fence, batch)

    def num_free_for_swap(self) -> int:
        return len(self._free_slots) + len(self._entries)

    def swap_out(self, gpu_block_ids: list[int]) -> list[int]:
        """Private slots holding copies of these GPU blocks, in order."""
        if len(gpu_block_ids) > self.num_free_for_swap():
            raise ValueError(f"swap-out of {len(gpu_block_ids)} blocks does not fit the host tier")
        slots = []
        for block_id in gpu_block_ids:
            slot = self._take_slot()
            self._private.add(slot)
            self.pending.append(BlockCopy(True, block_id, slot))
            slots.append(slot)
        self.num_swap_out_blocks += len(slots)
        return slots

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        if not self._entries:
            return None
        key, entry = self._entries.popitem(last=False)
        self._fence_on(key)  # the slot's next copy must not race its write-back
        self._written_back.pop(key, None)
        self.num_evictions += 1
        self.epoch += 1
        return entry.slot

    # ---- host -> GPU --------------------------------------------------
    def pin(self, refs: list[HostBlockRef]) -> None:
        for ref in refs:
            if ref.key is not None and ref.key in self._entries:
                self._pinned[ref.key] = self._entries.pop(ref.key)

    def unpin(self, refs: list[HostBlockRef]) -> None:
        """Pinned entries go back to the LRU as most recently used."""
        for ref in refs:
            if ref.key is not None and ref.key in self._pinned:
                self._entries[ref.key] = self._pinned.pop(ref.key)

    def load(self, ref: HostBlockRef, gpu_block_id: int) -> None:
        """Queue the copy into `gpu_block_id`; a private slot is free after it."""
        self.pending.append(BlockCopy(False, gpu_block_id, ref.slot))
        self.num_loads += 1
        if ref.key is None:
            self.release_private([ref.slot])

    def release_private(self, slots: list[int]) -> None:
        for slot in slots:
            self._private.remove(slot)
            self._free_slots.append(slot)

    # ---- bookkeeping --------------------------------------------------
    def take_pending(self) -> CopyBatch:
        batch = CopyBatch(self.pending, self.fence, self.batch)
        self.pending, self.fence = [], -1
        self.batch += 1
        return batch

    def entries(self) -> dict[CacheKey, HostEntry]:
        return {**self._entries, **self._pinned}

    def reset(self) -> None:
        """Forget cached entries (private swap slots stay)."""
        for entry in self.entries().values():
            self._free_slots.append(entry.slot)
        self._entries.clear()
        self._pinned.clear()
        # Slots are reused, and GPU blocks lose their hashes and are reused
        # without an eviction (no `save` to fence): fence on every write-back.
        self.fence = max([self.fence, *self._written_back.values()])
        self._written_back.clear()
        self.epoch += 1

    def check_integrity(self, private_slots: list[int]) -> None:
        """Every slot is free, cached or private (exactly one); private slots are
        exactly those the swapped requests hold."""
        owners: dict[int, str] = {}
        holders = [("free", s) for s in self._free_slots]
        holders += [("cached", e.slot) for e in self.entries().values()]
        holders += [("private", s) for s in self._private]
        for kind, slot in holders:
            if slot in owners:
                raise RuntimeError(f"host slot {slot} is both {owners[slot]} and {kind}")
            owners[slot] = kind
        if len(owners) != self.num_blocks:
            raise RuntimeError(f"host tier tracks {len(owners)} of {self.num_blocks} slots")
        if sorted(private_slots) != sorted(self._private):
            raise RuntimeError("private host slots disagree with the swapped requests")
        if self._pinned:
            raise RuntimeError("host entries left pinned outside an allocation")
