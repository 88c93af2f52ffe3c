"""The KV-content model both cache random walks check against: every slot a
step writes records the token prefix its KV depends on, and every key the
step's queries read must hold exactly the request's prefix, so a wrong hit,
a bad copy or a missing NULL can never pass unnoticed."""
from __future__ import annotations

from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.request import Request

# (GPU block id, offset in block) -> the token prefix whose last key was written there.
SlotContents = dict[tuple[int, int], tuple[int, ...]]


def write_and_read(manager: KVCacheManager, kv: SlotContents, request: Request,
                   start: int, end: int) -> None:
    """Write KV for positions [start, end) of `request`, then check every key
    the step's queries read, in every KV cache group."""
    tokens, bs = request.all_token_ids, manager.block_size
    for group, ids in zip(manager.managers, manager.get_block_ids(request.request_id)):
        assert len(ids) * bs >= end
        for pos in range(start, end):
            block = manager.pool.blocks[ids[pos // bs]]
            assert not block.is_null and block.ref_cnt == 1, "writing into a shared/NULL block"
            kv[(block.block_id, pos % bs)] = tuple(tokens[:pos + 1])
        spec = group.spec
        for key in set(range(spec.visible_start(start), end)) | set(range(min(spec.sink, end))):
            assert ids[key // bs] != 0, f"key {key} needed but NULL in {spec.describe()}"
            assert kv.get((ids[key // bs], key % bs)) == tuple(tokens[:key + 1]), \
                f"wrong KV for key {key} of {request.request_id} in {spec.describe()}"
