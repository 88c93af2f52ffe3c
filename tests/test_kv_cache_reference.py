"""KV cache figures against references written here from the definitions:

  - the blocks a request holds at every step, and their peak, against a
    brute-force count of the blocks its queries can read (keys k <= p with
    p - k < window or k < sink, from the spec's fields), and `max_blocks`
    (what admission uses) equal to that peak exactly, for every spec type;
  - a finished request freed tail first, seen through which prefix survives
    eviction;
  - `num_cached_tokens` kept from the first admission across a preemption;
  - fragmentation against slot counts worked out by hand.
"""
from __future__ import annotations

import pytest

from kvserve.cache.groups import make_kv_cache_groups
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.config import SchedulerConfig
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler

FULL = FullAttentionSpec()
SPECS = [FULL, SlidingWindowSpec(1), SlidingWindowSpec(5), SlidingWindowSpec(8),
         SlidingWindowSpec(7, sink=3), SlidingWindowSpec(12, sink=4), SlidingWindowSpec(9, sink=8)]


def visible_keys(spec, query_pos: int) -> set[int]:
    """Keys a query at `query_pos` reads, from the spec's fields alone."""
    window = getattr(spec, "window", None)
    return {k for k in range(query_pos + 1)
            if window is None or query_pos - k < window or k < spec.sink}


def needed_blocks(spec, block_size: int, first: int, end: int) -> set[int]:
    """Blocks a step computing positions [first, end) must hold: every block
    with a key some query of the step (or a later one) reads."""
    keys = set().union(*(visible_keys(spec, p) for p in range(first, end)))
    keys |= set(range(first, end))  # later queries read these (and they are written now)
    return {k // block_size for k in keys}


def reference_peak(spec, block_size: int, num_tokens: int, chunk: int) -> int:
    """Most blocks any step holds on the way to `num_tokens`, over every
    position a chunk of up to `chunk` tokens can start at."""
    return max(len(needed_blocks(spec, block_size, p, min(p + chunk, num_tokens)))
               for p in range(num_tokens))


def _manager(specs, num_blocks=400, block_size=4, **kwargs) -> KVCacheManager:
    return KVCacheManager(make_kv_cache_groups(specs), num_blocks, block_size, **kwargs)


def _held(manager: KVCacheManager, request_id: str) -> list[set[int]]:
    """Per group: table indices holding a real (non-NULL) block."""
    return [{i for i, b in enumerate(ids) if b != 0} for ids in manager.get_block_ids(request_id)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("block_size", [1, 3, 4, 8])
def test_max_blocks_is_the_brute_force_peak(spec, block_size):
    manager = _manager([spec], block_size=block_size).managers[0]
    for num_tokens in [1, 2, 5, 9, 16, 23, 40, 61]:
        for chunk in [1, 2, 4, 7, 16, 64]:
            assert manager.max_blocks(num_tokens, chunk) == reference_peak(
                spec, block_size, num_tokens, chunk), (num_tokens, chunk)


@pytest.mark.parametrize("chunk", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_blocks_held_every_step_and_their_peak(block_size, chunk):
    """One request per start position: decode one token at a time up to it,
    then one chunk. Every step holds exactly the needed blocks in every group
    (hybrid: all spec types at once), and the peak is `max_blocks`."""
    num_tokens = 30
    manager = _manager(SPECS, block_size=block_size, enable_prefix_caching=False)
    peaks = [0] * len(SPECS)
    for start in range(num_tokens):
        request = Request(f"r{start}", list(range(1, num_tokens + 1)), SamplingParams(max_tokens=1))
        steps = [1] * start + [min(chunk, num_tokens - start)]
        for num_new in steps:
            first = request.num_computed_tokens
            assert manager.allocate_slots(request, num_new)
            for g, (group, held) in enumerate(zip(manager.groups, _held(manager, request.request_id))):
                assert held == needed_blocks(group.spec, block_size, first, first + num_new), \
                    (group.spec.describe(), first, num_new)
                peaks[g] = max(peaks[g], len(held))
            request.num_computed_tokens += num_new
        manager.free(request)
    for g, m in enumerate(manager.managers):
        assert peaks[g] == m.max_blocks(num_tokens, chunk), manager.groups[g].spec.describe()
    assert manager.num_blocks_needed(num_tokens, chunk) == sum(peaks)
    manager.check_integrity()
    assert manager.usage == 0.0


def test_finished_request_frees_its_tail_first():
    """LRU reclaims the first freed block first: freeing tail first leaves the
    prefix (blocks 0 and 1) hittable when one block of the request is reclaimed."""
    manager = _manager([FULL], num_blocks=5, block_size=4, eviction_policy="lru")  # 4 usable
    prompt = list(range(10, 22))  # three full blocks
    first = Request("a", prompt, SamplingParams(max_tokens=4))
    assert manager.allocate_slots(first, 12)
    manager.free(first)
    other = Request("b", list(range(60, 68)), SamplingParams(max_tokens=4))
    assert manager.allocate_slots(other, 8)  # the never-used block, then one of a's
    assert manager.num_evictions == 1
    computed, hit = manager.get_computed_blocks(Request("c", prompt + [5], SamplingParams(max_tokens=4)))
    assert hit == 8  # head-first freeing would have evicted block 0: no hit at all


def test_num_cached_tokens_is_the_first_admission_hit():
    """A request hits 8 tokens (two blocks shared with a running one), is
    preempted, and is re-admitted with a larger hit (its own blocks were
    cached): its reported num_cached_tokens stays the first hit."""
    kv = _manager([FULL], num_blocks=12, block_size=4, eviction_policy="reuse")
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256), kv)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    holder = Request("A", list(range(100, 120)), params)
    late = Request("R", list(range(100, 108)) + [7, 8, 9], params)
    scheduler.add_request(holder)
    _run(scheduler, steps=1)
    scheduler.add_request(late)
    _run(scheduler)
    assert late.num_preemptions == 1 and holder.num_preemptions == 0
    readmission_hit = kv.prefix_cache_hits - 8
    assert readmission_hit == 12  # the premise: a different hit the second time
    assert late.num_cached_tokens == 8 and holder.num_cached_tokens == 0


def _run(scheduler: Scheduler, steps: int = 10_000) -> None:
    for step in range(steps):
        if not scheduler.has_unfinished:
            return
        out = scheduler.schedule()
        scheduler.update_after_step(out)
        for item in out.scheduled:
            if item.completes_sequence:
                request = item.request
                request.output_token_ids.append(50 + step % 7)
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    scheduler.remove_finished(request, RequestStatus.FINISHED_LENGTH)
    assert steps == 1 or not scheduler.has_unfinished


def test_fragmentation_against_hand_counts():
    manager = _manager([FULL], block_size=4)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=4))
    assert manager.allocate_slots(a, 10)
    a.num_computed_tokens = 10  # blocks hold 4, 4, 2 tokens
    assert manager.fragmentation() == pytest.approx(1 - 10 / 12)
    b = Request("b", list(range(8)) + [50, 51, 52], SamplingParams(max_tokens=4))
    computed, hit = manager.get_computed_blocks(b)
    assert hit == 8 and manager.allocate_slots(b, 3, computed)
    # Shared blocks count once: 4 + 4 + 2 (a's third) + 3 (b's third) of 4 blocks.
    assert manager.fragmentation() == pytest.approx(1 - 13 / 16)


def test_fragmentation_skips_dropped_window_blocks():
    manager = _manager([SlidingWindowSpec(4)], block_size=4)
    request = Request("a", list(range(13)), SamplingParams(max_tokens=4))
    assert manager.allocate_slots(request, 13)
    assert manager.fragmentation() == pytest.approx(1 - 13 / 16)
    request.num_computed_tokens = 13
    request.output_token_ids.append(1)
    assert manager.allocate_slots(request, 1)  # query at 13 reads keys 10..13: blocks 2, 3
    assert _held(manager, "a")[0] == {2, 3}
    assert manager.fragmentation() == pytest.approx(1 - 6 / 8)


def test_sliding_hit_of_a_single_block():
    """The shortest hit counts too: a request sharing only its first block
    with a cached prompt (window 4, blocks of 4) hits exactly that block."""
    manager = _manager([SlidingWindowSpec(4)], block_size=4)
    first = Request("a", list(range(12)), SamplingParams(max_tokens=4))
    assert manager.allocate_slots(first, 12)
    manager.free(first)
    computed, hit = manager.get_computed_blocks(Request("b", list(range(4)) + [90, 91], SamplingParams(max_tokens=4)))
    assert hit == 4 and len(computed.blocks[0]) == 1
