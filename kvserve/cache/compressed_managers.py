"""Block policy of V4's compressed groups and compressor state, registered
with the generic manager registry on import.

* `CompressedManager`: entries are never dropped (every later query may read
  them); only table slots where a window ends get a real block, the others
  hold the NULL block, so a group at rate 1/128 holds one block per 128 tokens
  (block_size < 128) whatever the block size.
* The compressor state is a window of raw inputs: `SlidingWindowManager`'s
  policy as is (blocks freed as the window passes; a hit needs the window's
  blocks, which is exactly what restores the state).
"""
from __future__ import annotations

from collections.abc import Sequence

from kvserve.cache.managers import (MANAGER_FOR_SPEC, HitBlock, SingleTypeManager, SlidingWindowManager,
                                    cdiv)
from kvserve.cache.v4_specs import CompressedSpec, CompressorStateSpec


class CompressedManager(SingleTypeManager):
    drops_blocks = False

    spec: CompressedSpec

    def _holds(self, index: int) -> bool:
        return self.spec.holds_entry(index, self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        held = len(self.blocks(request_id)) + num_hit_blocks
        return sum(1 for i in range(held, cdiv(num_tokens, self.block_size)) if self._holds(i))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> None:
        table = self.req_to_blocks.setdefault(request_id, [])
        indices = range(len(table), cdiv(num_tokens, self.block_size))
        fresh = iter(self.pool.get_new_blocks(sum(1 for i in indices if self._holds(i))))
        table.extend(next(fresh) if self._holds(i) else self.pool.null_block for i in indices)

    def max_blocks(self, num_tokens: int, chunk_tokens: int = 1) -> int:
        return sum(1 for i in range(cdiv(num_tokens, self.block_size)) if self._holds(i))

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], token_ids: Sequence[int],
                               max_length: int) -> list[HitBlock]:
        hit: list[HitBlock] = []
        for index in range(min(max_length // self.block_size, len(block_hashes))):
            if not self._holds(index):
                hit.append(self.pool.null_block)
                continue
            block = self.lookup(block_hashes, token_ids, index)
            if block is None:
                break
            hit.append(block)
        return hit


MANAGER_FOR_SPEC.setdefault(CompressedSpec, CompressedManager)
MANAGER_FOR_SPEC.setdefault(CompressorStateSpec, SlidingWindowManager)
