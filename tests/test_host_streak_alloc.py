"""`KVCacheManager.allocate_decode_rows`, the steady decode step's allocation
over arrays, against the row-by-row path it replaces (`allocate_slots` per
row, `allocate_rows`): the cache state after each step, the row each stops
at, and the consistency checker, over decode streaks that cross block
boundaries, run the pool dry, and (in an engine) meet preemption and aborts."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from kvserve.cache.groups import KVCacheGroup, make_kv_cache_groups
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from tests import random_traffic

FULL = FullAttentionSpec()
# Two full groups (rooms of two tails each), one full, and one that drops blocks (no rooms).
LAYOUTS = {"full": make_kv_cache_groups([FULL]),
           "full x2": [KVCacheGroup(FULL, (0,)), KVCacheGroup(FULL, (1,))],
           "full + sliding": make_kv_cache_groups([FULL, SlidingWindowSpec(6)])}


def _state(manager: KVCacheManager, request_ids: list[str]) -> tuple:
    """Everything a step's allocation changes, the lagging ends and tail counters
    synced (without ending a decode run: the next step must be able to continue it;
    writing the ends hides a run's lagging ones, so some tests look only every few steps)."""
    manager._write_ends()
    for request_id in list(manager._room):
        manager._sync_tails(request_id)
    fill = manager._held.fill
    return ([manager.get_block_ids(r) for r in request_ids], dict(manager._num_tokens),
            {r: room[:2] + (room[3],) for r, room in manager._room.items()},
            sorted(manager.pool.cached), [b.block_id for b in manager.pool.free_queue],
            fill.used_slots, fill.num_held)


def _decoding(manager: KVCacheManager, n: int, rng: random.Random) -> list[Request]:
    requests = []
    for i in range(n):
        r = Request(str(i), [rng.randrange(3, 50) for _ in range(rng.randint(1, 12))],
                    SamplingParams(max_tokens=1000))
        computed, hit = manager.get_computed_blocks(r)
        if not manager.allocate_slots(r, r.num_tokens - hit, computed):
            break
        r.num_computed_tokens = r.num_tokens
        requests.append(r)
    return requests


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decode_rows_change_the_cache_as_allocate_slots_row_by_row(layout, caching):
    """Twin managers, one stepped by `allocate_decode_rows`, the other by
    `allocate_slots` per row: equal states and stopping rows every step, while
    requests cross block boundaries, leave (free) and the pool runs dry."""
    rng = random.Random(7)
    stops, runs = set(), set()
    for trial in range(6):
        managers = [KVCacheManager(LAYOUTS[layout], num_blocks=40, block_size=4, enable_prefix_caching=caching)
                    for _ in range(2)]
        walks = [_decoding(m, 8, random.Random(trial)) for m in managers]
        streak_ids = None
        for step in range(20):
            rows = [(r, 1, r.num_computed_tokens) for r in walks[0]]
            starts = np.array([r.num_computed_tokens for r in walks[0]], dtype=np.int64)
            # One list while the rows stay, as the scheduler's streak keeps it: the cache's decode run goes on.
            streak_ids = streak_ids or [r.request_id for r in walks[0]]
            done = managers[0].allocate_decode_rows(rows, streak_ids, starts)
            expected = next((i for i, r in enumerate(walks[1]) if not managers[1].allocate_slots(r, 1)),
                            len(rows))
            assert done == expected, (trial, step)
            runs.add(managers[0]._run is not None)
            ids = [r.request_id for r in walks[0]]
            assert _state(managers[0], ids) == _state(managers[1], ids), (trial, step)
            managers[0].check_integrity()
            stops.add(done < len(rows))
            token = rng.randrange(3, 50)
            # A request leaves, making room: the newest when the pool ran dry, sometimes any.
            leaves = len(rows) - 1 if done < len(rows) else rng.randrange(len(rows)) if rng.random() < 0.2 else None
            if leaves is not None:
                streak_ids = None
            for walk, manager in zip(walks, managers):
                for r in walk[:done]:
                    r.num_computed_tokens += 1
                    r.output_token_ids.append(token)
                if leaves is not None:
                    manager.free(walk.pop(leaves))
            if not walks[0]:
                break
    assert stops == {True, False}   # the pool ran dry on the way, and steps went through
    assert runs == ({False} if layout == "full + sliding" else {True, False})   # decode runs went on and ended


def test_decode_rows_whose_start_is_not_the_cache_end_take_the_row_by_row_path():
    """A start that differs from the end the cache holds (a step computed fewer
    tokens than scheduled) is the general path's, not the rooms'."""
    managers = [KVCacheManager(LAYOUTS["full"], num_blocks=20, block_size=4) for _ in range(2)]
    walks = [_decoding(m, 3, random.Random(1)) for m in managers]
    for walk, manager in zip(walks, managers):
        assert manager.allocate_slots(walk[1], 3)   # scheduled 3, computed 1 (below)
        walk[1].num_computed_tokens += 1
    rows = [(r, 1, r.num_computed_tokens) for r in walks[0]]
    starts = np.array([r.num_computed_tokens for r in walks[0]])
    assert managers[0].allocate_decode_rows(rows, [r.request_id for r in walks[0]], starts) == 3
    assert all(managers[1].allocate_slots(r, 1) for r in walks[1])
    ids = [r.request_id for r in walks[0]]
    assert _state(managers[0], ids) == _state(managers[1], ids)
    managers[0].check_integrity()


def test_a_decode_run_whose_starts_moved_otherwise_is_not_continued():
    """The same id list twice, the second time with a start that is not where the
    first step left its row (one row rolled back, as a step computing fewer tokens
    would): the run must not go on over it; both managers agree with row-by-row."""
    managers = [KVCacheManager(LAYOUTS["full"], num_blocks=30, block_size=4) for _ in range(2)]
    walks = [_decoding(m, 3, random.Random(2)) for m in managers]
    ids = [r.request_id for r in walks[0]]
    for step, rollback in enumerate((False, True)):
        rows = [(r, 1, r.num_computed_tokens) for r in walks[0]]
        starts = np.array([r.num_computed_tokens for r in walks[0]])
        assert managers[0].allocate_decode_rows(rows, ids, starts) == 3
        assert all(managers[1].allocate_slots(r, 1) for r in walks[1])
        assert _state(managers[0], ids) == _state(managers[1], ids), step
        for walk in walks:
            for r in walk:
                r.num_computed_tokens += 1
            walk[0].num_computed_tokens -= 1   # row 0 computed nothing: its next start is its last one
    managers[0].check_integrity()


def test_an_engine_s_decode_rows_equal_the_row_by_row_allocation():
    """An engine on a random mix (arrivals, output limits, aborts, preemption
    for lack of blocks): at every `allocate_decode_rows` call, a copy of the
    cache takes the same rows through `allocate_rows`; both stop at the same
    row and end in the same state. The fast path runs many times, crossing
    block boundaries and running out of blocks."""
    from kvserve.entrypoints.llm import LLM
    llm = LLM("dummy:tiny-llama", load_format="dummy", device="cpu", dtype="float32", block_size=4,
              max_model_len=96, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=64)
    engine, rng = llm.engine, random.Random(5)
    kv, counts = engine.kv_cache, {"calls": 0, "stopped": 0, "opened": 0}
    allocate_decode_rows = kv.allocate_decode_rows

    narrow = kv._narrowed_run

    def counted_narrow(*args):
        run = narrow(*args)
        counts["narrowed"] += run is not None
        return run

    def checked(rows, request_ids, starts, previous_rows=None):
        twin, twin_rows = copy.deepcopy((kv, rows))
        opened = kv.pool.num_free_blocks
        done = allocate_decode_rows(rows, request_ids, starts, previous_rows)
        assert done == twin.allocate_rows(twin_rows)
        assert _state(kv, request_ids) == _state(twin, request_ids)
        kv.check_integrity()
        counts["calls"] += 1
        counts["stopped"] += done < len(rows)
        counts["opened"] += kv.pool.num_free_blocks < opened
        return done
    kv.allocate_decode_rows, kv._narrowed_run = checked, counted_narrow
    counts["narrowed"] = 0
    requests = random_traffic.drive(engine, rng, steps=300, max_requests=50, arrive=0.2)
    assert counts["calls"] > 50 and counts["stopped"] > 0 and counts["opened"] > 10, counts
    assert counts["narrowed"] > 5, counts   # runs went on without rows that finished
    assert engine.scheduler.num_preemptions > 0
    assert all(r.is_finished for r in requests)
    assert kv.num_free_blocks == kv.num_usable_blocks   # nothing leaked


def test_a_roomless_row_inside_its_block_stops_the_openings_and_takes_the_general_path():
    """A decode run's row without a room whose end is no block boundary (its room
    forgotten here: the direct path must refuse it, `_opens_one_block`): the block
    openings stop at it, the step goes on row by row from there, and each row
    holds exactly the blocks its tokens need, as the row-by-row path leaves them."""
    managers = [KVCacheManager(LAYOUTS["full"], num_blocks=40, block_size=4, enable_prefix_caching=False)
                for _ in range(2)]
    walks = []
    for manager in managers:
        requests = [Request(str(i), list(range(3, 3 + n)), SamplingParams(max_tokens=100))
                    for i, n in enumerate((4, 6, 8))]   # ends 4 and 8 fill their tails: no room
        for r in requests:
            assert manager.allocate_slots(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens
        walks.append(requests)
    del managers[0]._room["1"]   # end 6, inside its second block
    rows = [(r, 1, r.num_computed_tokens) for r in walks[0]]
    starts = np.array([r.num_computed_tokens for r in walks[0]], dtype=np.int64)
    assert managers[0].allocate_decode_rows(rows, ["0", "1", "2"], starts) == 3
    assert all(managers[1].allocate_slots(r, 1) for r in walks[1])
    assert [len(managers[0].get_block_ids(r)[0]) for r in "012"] == [2, 2, 3]
    assert [managers[0].get_block_ids(r) for r in "012"] == [managers[1].get_block_ids(r) for r in "012"]
    # and each row's end: row 0 opened its block before the run was left, so it is one further too
    assert managers[0]._num_tokens == managers[1]._num_tokens == {"0": 5, "1": 7, "2": 9}
    managers[0].check_integrity()


@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("layout", ["full", "full x2"])
def test_many_rows_crossing_at_once_equal_the_row_by_row_allocation(layout, block_size):
    """Many rows of a decode run open their next blocks in the same step (a group
    at a time, `_append_next_blocks`), and at 2-token blocks fill the block they
    opened in that step too: twin managers, one stepped by `allocate_decode_rows`,
    the other row by row, hand out the same blocks in the same order and keep the
    same tables (the batch tables' numpy rows too, grown past their first width),
    fill counters and rooms, every step, until the pool runs dry."""
    rng = random.Random(block_size)
    groups = len(LAYOUTS[layout])   # 20 blocks a row in each group: the tables pass 16 before the pool runs dry
    managers = [KVCacheManager(LAYOUTS[layout], num_blocks=20 * 40 * groups, block_size=block_size,
                               max_table_width=64) for _ in range(2)]
    walks = [_decoding(m, 40, random.Random(3)) for m in managers]
    ids = [r.request_id for r in walks[0]]
    crossings = 0
    for step in range(100):
        rows = [(r, 1, r.num_computed_tokens) for r in walks[0]]
        starts = np.array([r.num_computed_tokens for r in walks[0]], dtype=np.int64)
        crossings = max(crossings, int(np.sum(starts % block_size == 0)))
        done = managers[0].allocate_decode_rows(rows, ids, starts)
        assert done == next((i for i, r in enumerate(walks[1]) if not managers[1].allocate_slots(r, 1)), len(rows))
        tables = [m.block_tables(ids) for m in managers]
        assert all(a.equal(b) for a, b in zip(*tables)), step
        if step % 3 == 2 or done < len(rows):   # between looks, the run's ends lag (`_state`)
            assert _state(managers[0], ids) == _state(managers[1], ids), step
            managers[0].check_integrity()
        if done < len(rows):
            break
        token = rng.randrange(3, 50)
        for walk in walks:
            for r in walk:
                r.num_computed_tokens += 1
                r.output_token_ids.append(token)
    assert done < len(rows) and crossings >= 10   # many crossings a step, then the pool ran dry
    assert max(len(managers[0].get_block_ids(r)[0]) for r in ids) > 16   # the numpy rows grew wider


def test_a_roomless_row_whose_table_holds_its_next_block_takes_the_general_path():
    """A decode run's row on a block boundary whose table already holds the next
    block (a step scheduled 5 tokens and computed 4: the end moved back, the
    block stays) needs no new block: the openings stop at it (each group's
    `num_opening_one_block`), and every row ends as the row-by-row path leaves it."""
    managers = [KVCacheManager(LAYOUTS["full x2"], num_blocks=60, block_size=4, enable_prefix_caching=False)
                for _ in range(2)]
    walks = []
    for manager in managers:
        requests = [Request(str(i), list(range(3, 7)), SamplingParams(max_tokens=100)) for i in range(3)]
        for r in requests:
            assert manager.allocate_slots(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens
        assert manager.allocate_slots(requests[1], 5)   # tokens 4..8 scheduled: 3 blocks
        requests[1].num_computed_tokens = 8              # 4 of them computed
        assert manager.allocate_slots(requests[1], 0)    # the end back at 8, a block boundary
        walks.append(requests)
    assert [len(t) for t in managers[0].get_block_ids("1")] == [3, 3] and "1" not in managers[0]._room
    rows = [(r, 1, r.num_computed_tokens) for r in walks[0]]
    starts = np.array([r.num_computed_tokens for r in walks[0]], dtype=np.int64)
    assert managers[0].allocate_decode_rows(rows, ["0", "1", "2"], starts) == 3
    assert all(managers[1].allocate_slots(r, 1) for r in walks[1])
    assert [managers[0].get_block_ids(r) for r in "012"] == [managers[1].get_block_ids(r) for r in "012"]
    assert [len(managers[0].get_block_ids(r)[0]) for r in "012"] == [2, 3, 2]
    assert _state(managers[0], list("012")) == _state(managers[1], list("012"))
    managers[0].check_integrity()


@pytest.mark.parametrize("layout", ["full", "full x2"])
def test_a_run_goes_on_without_the_rows_that_left_as_row_by_row(layout):
    """Rows leave a decode run (freed, or kept out with their blocks, as a row
    whose last token is in flight) and the next step names the rows it keeps of
    the last (`previous_rows`): the run goes on with them, and twin managers,
    one stepped row by row, agree every step. A call that changes a kept row
    between the free and the step (here: 2 more tokens scheduled for it) ends
    what the frees kept of the run: its stale end must not be taken for the row's;
    nor may a freed row's, should a caller keep it."""
    rng = random.Random(11)
    managers = [KVCacheManager(LAYOUTS[layout], num_blocks=400, block_size=4) for _ in range(2)]
    walks = [_decoding(m, 32, random.Random(4)) for m in managers]
    narrowed = {"calls": 0}
    narrow = managers[0]._narrowed_run

    def counted(*args):
        run = narrow(*args)
        narrowed["calls"] += run is not None
        return run
    managers[0]._narrowed_run = counted
    ids, previous_rows, changed = [r.request_id for r in walks[0]], None, 0
    for step in range(40):
        rows = [(r, 1, r.num_computed_tokens) for r in walks[0]]
        starts = np.array([r.num_computed_tokens for r in walks[0]], dtype=np.int64)
        done = managers[0].allocate_decode_rows(rows, ids, starts, previous_rows)
        assert done == next((i for i, r in enumerate(walks[1]) if not managers[1].allocate_slots(r, 1)), len(rows))
        if step % 4 == 3:   # between looks, the run's ends lag (`_state`)
            assert _state(managers[0], ids) == _state(managers[1], ids), step
            managers[0].check_integrity()
        for walk in walks:
            for r in walk:
                r.num_computed_tokens += 1
                r.output_token_ids.append(7)
        kept = list(range(len(ids)))
        for _ in range(rng.randrange(3)):   # rows leave: freed, or kept out holding their blocks
            i = kept.pop(rng.randrange(len(kept)))
            if rng.random() < 0.6:
                for manager, walk in zip(managers, walks):
                    manager.free(walk[i])
        if step % 5 == 4 and kept:   # a kept row's state changes after the frees
            for manager, walk in zip(managers, walks):
                assert manager.allocate_slots(walk[kept[0]], 2)
            changed += 1
        if step % 9 == 8 and kept:   # a kept row freed (no caller does): it allocates anew, as row by row
            for manager, walk in zip(managers, walks):
                manager.free(walk[kept[-1]])
            changed += 1
        for w, walk in enumerate(walks):
            walks[w] = [walk[i] for i in kept]
        previous_rows, ids = (ids, np.array(kept, dtype=np.int64)), [ids[i] for i in kept]
        if len(ids) < 4:
            break
    assert _state(managers[0], ids) == _state(managers[1], ids)
    managers[0].check_integrity()
    assert narrowed["calls"] > 10 and changed > 4, narrowed
