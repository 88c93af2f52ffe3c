"""The KV-content model both cache random walks check against: every slot a
step writes records the token prefix its KV depends on, and every key the
step's queries read must hold exactly the request's prefix, so a wrong hit,
a bad copy or a missing NULL can never pass unnoticed."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

# (GPU block id, offset in block) -> the token prefix whose last key was written there.
SlotContents = dict[tuple[int, int], tuple[int, ...]]


@dataclass
class WalkState:
    """What both walks track besides their own extras: the manager, the
    request queues, finished histories (the next turn of a conversation
    re-sends one) and the GPU KV contents."""

    manager: KVCacheManager
    rng: random.Random
    prefixes: list[list[int]]
    max_tokens: int
    vocab: int
    running: dict[str, Request] = field(default_factory=dict)
    waiting: list[Request] = field(default_factory=list)
    history: list[list[int]] = field(default_factory=list)
    kv: SlotContents = field(default_factory=dict)
    next_id: int = 0

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    def new_request(self, prompt: list[int]) -> Request:
        self.next_id += 1
        return Request(f"r{self.next_id}", prompt, SamplingParams(max_tokens=self.max_tokens))

    def random_prompt(self, max_extra: int) -> list[int]:
        """A cut of a shared prefix plus up to `max_extra` random tokens."""
        prefix = self.rng.choice(self.prefixes)
        cut = self.rng.randint(1, len(prefix))
        return prefix[:cut] + [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, max_extra))]

    def next_turn_prompt(self, room: int) -> list[int]:
        """A finished request's whole history (cut `room` short of max_tokens) plus a few new tokens."""
        past = self.rng.choice(self.history)[:self.max_tokens - room]
        return past + [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 8))]


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
        for key in set(range(first_visible_key(spec, start), end)) | set(range(min(spec.sink, end))):
            assert ids[key // bs] != 0, f"key {key} needed but NULL in {spec.describe()}"
            assert kv.get((ids[key // bs], key % bs)) == tuple(tokens[:key + 1]), \
                f"wrong KV for key {key} of {request.request_id} in {spec.describe()}"


def first_visible_key(spec, query_pos: int) -> int:
    """The first key outside the sink a query at `query_pos` reads, from the
    spec's own fields (a query at p sees k <= p with p - k < window), not the
    package's `visible_start`: a wrong window there must not hide here."""
    window = getattr(spec, "window", None)
    return 0 if window is None else max(0, query_pos - (window - 1))
