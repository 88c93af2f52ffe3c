"""Running totals behind `KVCacheManager.fragmentation`: how many distinct
blocks requests hold, and how many of their slots hold a token.

A block's fill, as seen by one holder (a request's table entry at index i in
one group, the request covering tokens [0, end)), is
min(block_size, max(0, end - i * block_size)). A block shared by several
holders counts once, at its largest fill. The KV cache manager reports every
change of a holder's fill here (allocate, free, a request's end moving), so
reading the totals costs O(1) instead of a walk over every held block.
"""
from __future__ import annotations


class BlockFill:
    """Per held block, a count of its holders by fill; the totals stay exact."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # block id -> {fill: holders with that fill}; absent when nobody holds it.
        self._fills: dict[int, dict[int, int]] = {}
        self.num_held = 0      # distinct blocks with at least one holder
        self.used_slots = 0    # sum over held blocks of their largest fill

    def fill(self, index: int, end: int) -> int:
        """Slots of table entry `index` that tokens [0, end) occupy."""
        return min(self.block_size, max(0, end - index * self.block_size))

    def add(self, block_id: int, fill: int) -> None:
        fills = self._fills.get(block_id)
        if fills is None:
            fills = self._fills[block_id] = {}
            self.num_held += 1
            old = 0
        else:
            old = max(fills)
        fills[fill] = fills.get(fill, 0) + 1
        if fill > old:
            self.used_slots += fill - old

    def remove(self, block_id: int, fill: int) -> None:
        fills = self._fills.get(block_id)
        if fills is None or fill not in fills:
            raise RuntimeError(f"block {block_id} has no holder with fill {fill} to remove")
        old = max(fills)
        if fills[fill] > 1:
            fills[fill] -= 1
            return
        del fills[fill]
        if not fills:
            del self._fills[block_id]
            self.num_held -= 1
            self.used_slots -= old
        elif fill == old:
            self.used_slots -= old - max(fills)

    def move(self, block_id: int, old_fill: int, new_fill: int) -> None:
        """One holder's fill changed (its request's end moved)."""
        if old_fill != new_fill:
            self.remove(block_id, old_fill)
            self.add(block_id, new_fill)

    def fragmentation(self) -> float:
        """Share of slots in held blocks that hold no token (0.0 when none is held)."""
        if not self.num_held:
            return 0.0
        return 1.0 - self.used_slots / (self.num_held * self.block_size)

    def largest_fills(self) -> dict[int, int]:
        """Block id -> largest fill over its holders (for integrity checks)."""
        return {block_id: max(fills) for block_id, fills in self._fills.items()}
