"""KVCacheManager: the only KV-cache object the scheduler talks to.

Owns the block pool, one per-type manager per KV cache group, and the cache
statistics. It coordinates the groups (a prefix hit must be valid for every
group; an allocation succeeds for all groups or changes nothing) and never
looks at spec types: per-type behaviour lives in `managers.py`.

Scheduler contract for `num_computed_tokens`:
  1. Admitting a request: `computed, hit = get_computed_blocks(request)`, then
     `allocate_slots(request, num_new_tokens, computed)`. allocate_slots treats
     tokens [0, request.num_computed_tokens + hit) as already computed (the hit
     is NOT yet in num_computed_tokens) and covers
     [0, num_computed_tokens + hit + num_new_tokens).
  2. Only if it returned True: `request.num_computed_tokens += hit`
     (and `num_cached_tokens = hit` on first admission).
  3. Later steps: `allocate_slots(request, num_new_tokens)`, or for a step's
     running requests all at once `allocate_rows(rows)` (a steady decode
     step's: `allocate_decode_rows`); the first query of
     the step is at `request.num_computed_tokens`, so advance it by the tokens
     actually computed before the next call.
  Call allocate_slots right after get_computed_blocks: a hit whose blocks were
  evicted in between is rejected with ValueError.

Prefix caching: prompt blocks (and any block a multi-token step fills) are
offered to the hash map as they fill; blocks that one-token decode steps fill
are offered when the request is freed or swapped out (`_offer_deferred`),
hashed in one walk, as SGLang's radix cache inserts a request's output when it
finishes. A request whose prompt repeats another's output while that one still
runs therefore recomputes it.

Host tier (optional, `host_tier.py`): cached GPU blocks are written back to
host slots when they become free (in the background) or, at the latest, when
evicted; a hit may then contain `HostBlockRef`s, which
allocate_slots replaces by fresh GPU blocks with queued loads. A preempted
request can instead be swapped out (`swap_out`): its blocks go to private
host slots, and its next `get_computed_blocks` returns them as a hit of its
old `num_computed_tokens` (`is_swap_in`), so re-admission is the same code
path. With prefix caching only the tail past the blocks already offered to
the hash map is copied: the cached prefix stays in the GPU cache (and goes to
the host on eviction like any cached block), and swap-in looks it up again;
if part of it is gone everywhere, the swap is dropped and the request
resumes from the prefix that is left, recomputing the rest. The queued copies
go to the runner as one `CopyBatch` per step (`take_pending_copies`); what the
next forward must wait for is `host_tier.py`'s rule.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from operator import not_
from typing import TYPE_CHECKING, Any

import numpy as np

from kvserve.cache import groups as layout
from kvserve.cache.block_fill import HeldTables
from kvserve.cache.decode_run import DecodeRun, room_tails
from kvserve.cache.block_pool import BlockPool, KVBlock
from kvserve.cache.eviction import make_eviction_policy
from kvserve.cache.groups import KVCacheGroup
from kvserve.cache.hashing import block_contents, extend_block_hashes
from kvserve.cache.host_tier import CopyBatch, HostBlockRef, HostTier
from kvserve.cache.managers import HitBlock, SingleTypeManager, make_manager

if TYPE_CHECKING:
    import torch

    from kvserve.request import Request


@dataclass
class ComputedBlocks:
    """A prefix hit: per-group hit blocks (NULL where unneeded) and its length.

    Blocks in the host tier are `HostBlockRef`s until admission loads them.
    A swap-in is a "hit" on the request's own swapped-out blocks.
    """

    blocks: list[list[HitBlock]]
    num_tokens: int
    # (pool, host tier) epochs at lookup; if they moved, the hit is re-verified.
    epoch: tuple[int, int] = (-1, -1)
    is_swap_in: bool = False

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the hit that admission must load from the host tier."""
        return sum(1 for group in self.blocks for block in group if block.on_host)

    def block_ids(self) -> list[list[int]]:
        """GPU block ids (-1 for blocks still on the host)."""
        return [[-1 if block.on_host else block.block_id for block in group]
                for group in self.blocks]


@dataclass
class SwappedKV:
    """A swapped-out request: its cached prefix length (looked up again at
    swap-in) and, past it, per-group tables of private host slots (NULL kept)."""

    tables: list[list[HitBlock]]
    num_tokens: int
    num_prefix_tokens: int = 0

    def slots(self) -> list[int]:
        return [block.slot for table in self.tables for block in table if block.on_host]


class KVCacheManager:
    """Allocates, caches and frees KV blocks for requests across all groups."""

    def __init__(self, groups: list[KVCacheGroup], num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True,
                 eviction_policy: str = "reuse", host_tier: HostTier | None = None,
                 max_table_width: int | None = None) -> None:
        """`max_table_width`: the most blocks a request's table holds (max_model_len
        in blocks); given, the step's batch tables are padded to fewer distinct
        widths (`BlockTableRows`)."""
        if not groups:
            raise ValueError("KVCacheManager needs at least one KV cache group")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.groups = list(groups)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, make_eviction_policy(eviction_policy))
        self.host_tier = host_tier
        if host_tier is not None and enable_prefix_caching:
            self.pool.on_evict = host_tier.save
            self.pool.on_free_cached = host_tier.write_back
        lookup_tier = host_tier if enable_prefix_caching else None
        self.managers: list[SingleTypeManager] = [
            make_manager(group.spec, self.pool, block_size, group_id, lookup_tier)
            for group_id, group in enumerate(self.groups)]
        self._swapped: dict[str, SwappedKV] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Whether any group frees blocks as queries move (then no step is a no-op).
        self._drops_blocks = any(m.drops_blocks for m in self.managers)
        # Whether a step's one token past a block boundary can take the direct path (`_open_next_block`).
        self._opens_blocks = block_size > 1 and not self._drops_blocks
        self.host_hit_tokens = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_swap_drops = 0  # swaps abandoned: their cached prefix left both tiers
        # End of each request's computed+scheduled range (for fragmentation).
        self._num_tokens: dict[str, int] = {}
        # Block-id mirror and fill counters, updated where tables change.
        self._held = HeldTables(self.managers, block_size, max_table_width)
        # Per request holding blocks: (first end, last end, tail fill counters, the end
        # they count) between which allocate_slots only moves the end inside the tail
        # block (`_set_room`); the counters lag behind until `_sync_tails`.
        self._room: dict[str, tuple[int, int, list[dict[int, int]], int]] = {}
        # The steady decode steps' rows while they hold (`allocate_decode_rows`); None between.
        self._run: DecodeRun | None = None

    # ---- layout -------------------------------------------------------
    @property
    def group_size(self) -> int:
        return layout.group_size(self.groups)

    @property
    def layer_to_group(self) -> list[int]:
        return layout.layer_to_group(self.groups)

    @property
    def layer_to_slot(self) -> list[int]:
        return layout.layer_to_slot(self.groups)

    # ---- stats --------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the reserved null block."""
        return self.pool.num_blocks - 1

    # ---- prefix hits --------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """Longest cached prefix valid for every group, capped at num_tokens - 1
        so at least one token is computed. Counts nothing: the caller records
        the lookup with `record_prefix_lookup` once admission succeeds, so a
        retried admission is not counted twice. A swapped-out request gets
        its own swapped blocks back instead."""
        self._settle()
        swapped = self._swapped.get(request.request_id)
        if swapped is not None:
            return self._swap_in_hit(request, swapped)
        if not self.enable_prefix_caching:
            return self._no_hit(), 0
        extend_block_hashes(request, self.block_size)
        hit = self._longest_common_hit(request.block_hashes, request.all_token_ids,
                                       request.num_tokens - 1)
        return hit, hit.num_tokens

    def _swap_in_hit(self, request: Request, swapped: SwappedKV) -> tuple[ComputedBlocks, int]:
        prefix = self._no_hit()
        if swapped.num_prefix_tokens:
            extend_block_hashes(request, self.block_size)
            prefix = self._longest_common_hit(request.block_hashes, request.all_token_ids,
                                              swapped.num_prefix_tokens)
            if prefix.num_tokens < swapped.num_prefix_tokens:
                # Part of the cached prefix left both tiers: resume from what is
                # left as a plain hit; the private tail cannot follow it.
                del self._swapped[request.request_id]
                self.host_tier.release_private(swapped.slots())
                self.num_swap_drops += 1
                return prefix, prefix.num_tokens
        blocks = [p + t for p, t in zip(prefix.blocks, swapped.tables)]
        return (ComputedBlocks(blocks, swapped.num_tokens, self._epoch(), is_swap_in=True),
                swapped.num_tokens)

    def first_block_hash(self, request: Request) -> bytes | None:
        """The hash of the request's first full block (None without prefix
        caching or a full block): two requests with the same one share a
        prefix, the scheduler's "prefix" policy's cheap test."""
        if not self.enable_prefix_caching or request.num_tokens < self.block_size:
            return None
        if not request.block_hashes:
            extend_block_hashes(request, self.block_size)
        return request.block_hashes[0]

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int,
                             computed: ComputedBlocks | None = None) -> None:
        """Count one admitted lookup: queries and hits (host hits too), in tokens.
        A swap-in is not a lookup and counts nothing here."""
        if computed is not None and computed.is_swap_in:
            return
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            if computed is not None:
                self.host_hit_tokens += self.num_host_tokens(computed)

    def num_host_tokens(self, computed: ComputedBlocks) -> int:
        """Tokens of a hit whose KV comes from the host tier (in any group)."""
        indices = {i for group in computed.blocks for i, b in enumerate(group) if b.on_host}
        return len(indices) * self.block_size

    def _epoch(self) -> tuple[int, int]:
        return self.pool.epoch, self.host_tier.epoch if self.host_tier is not None else 0

    def _longest_common_hit(self, block_hashes: Sequence[bytes], token_ids: Sequence[int],
                            max_length: int) -> ComputedBlocks:
        # Sliding-window validity is not prefix-closed: shrinking the length
        # for one group can invalidate another's, so iterate to a fixed point.
        length = max(0, max_length)
        while True:
            hits = [m.find_longest_cache_hit(block_hashes, token_ids, length)
                    for m in self.managers]
            lengths = {len(blocks) * self.block_size for blocks in hits}
            if len(lengths) == 1:
                return ComputedBlocks(hits, lengths.pop(), self._epoch())
            length = min(lengths)

    def _no_hit(self) -> ComputedBlocks:
        return ComputedBlocks([[] for _ in self.managers], 0, self._epoch())

    # ---- allocation ---------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None, reserve: int = 0) -> bool:
        """Cover tokens [0, num_computed_tokens + hit + num_new_tokens) in every group.

        Tokens [0, num_computed_tokens + hit) count as computed; the first query
        of this step is at that position, and sliding groups drop blocks no query
        from there on reads. Blocks that become full of known tokens are cached,
        except those one-token decode steps fill: they are cached when the
        request's blocks are freed or swapped (`_offer_deferred`).
        Returns False, changing nothing, when the free blocks (cached free blocks
        included) do not suffice. See the module docstring for the contract.
        """
        self._settle()
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if computed is None or computed.num_tokens == 0:
            return self._extend(request, num_new_tokens, reserve)
        self._check_hit_usable(request, computed)
        return self._allocate(request, num_new_tokens, computed, reserve)

    def _extend(self, request: Request, num_new_tokens: int, reserve: int) -> bool:
        """`allocate_slots` without a hit: the decode step's two direct paths
        first, then the general one."""
        if self._move_within_tail(request, num_new_tokens):
            return True  # the common decode step: nothing to allocate or free
        if self._open_next_block(request, num_new_tokens, reserve):
            return True  # a decode step crossing into a new block: 1 in block_size steps
        return self._allocate(request, num_new_tokens, None, reserve)

    def _allocate(self, request: Request, num_new_tokens: int, hit: ComputedBlocks | None,
                  reserve: int) -> bool:
        """The general path: any hit (checked usable) and any number of tokens."""
        self._sync_tails(request.request_id)  # the general path reads the fill counters
        first_query_pos = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        total = first_query_pos + num_new_tokens
        if not self._can_allocate(request.request_id, hit, first_query_pos, total, reserve):
            return False
        self._apply_allocation(request.request_id, hit, first_query_pos, total)
        if hit is not None and hit.is_swap_in:
            del self._swapped[request.request_id]
            self.num_swap_ins += 1
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, total)
        self._set_room(request.request_id, total)
        return True

    def allocate_rows(self, rows: Sequence[tuple[Request, int, int]], first: int = 0) -> int:
        """`allocate_slots(request, num_new_tokens)` for each (request,
        num_new_tokens, _) of `rows[first:]` in order, stopping at the first
        that fails; returns its index (len(rows) when none failed).

        Every running request comes here every step, so a row whose end stays
        inside its room (`_set_room`) is moved right here, with no call: the
        end and the fill total, as `_move_within_tail` does (hot path). A row
        that fills its tail leaves the room here too, and one that opens the
        next block goes straight to `_open_next_block`: at 256 running requests
        and 16-token blocks, 32 rows a step."""
        self._settle()
        room_of, ends, moved = self._room.get, self._num_tokens, 0
        for i in range(first, len(rows)):
            request, num_new, _ = rows[i]
            request_id = request.request_id
            room = room_of(request_id)
            total = request.num_computed_tokens + num_new
            if room is not None and room[0] <= total <= room[1] and num_new >= 0:  # a negative count raises below
                moved += (total - ends[request_id]) * len(room[2])
                ends[request_id] = total
                if total == room[1]:  # the tail is full: the next token opens a block
                    self._leave_room(request_id)
                continue
            self._held.fill.used_slots += moved
            moved = 0
            if room is None and num_new > 0 and self._open_next_block(request, num_new, 0):
                continue
            if not self.allocate_slots(request, num_new):
                return i
        self._held.fill.used_slots += moved
        return len(rows)

    def allocate_decode_rows(self, rows: Sequence[tuple[Request, int, int]], request_ids: list[str],
                             starts: np.ndarray,
                             previous_rows: tuple[list[str], np.ndarray] | None = None) -> int:
        """`allocate_rows(rows)` for the rows of a steady decode step (the
        scheduler's `DecodeStreak`), whose caller vouches that each row computes
        one token at `starts[i]`, its request's num_computed_tokens, and passes
        the rows' request ids, which it keeps across steps. Where each start is
        also the end the cache holds, the rows form a `DecodeRun`: a row with a
        room stays inside it (the room holds its end, `_check_room`, so it holds
        end + 1) and all of them move as one array; the rows without a room (one
        in 16 at 16-token blocks: they open a block) go first, their blocks taken
        from the pool at once (`_open_run_blocks`).
        That is the same as taking the rows in order: a room is its request's
        alone (`_set_room`) and the fill total is a sum. Where a row's block
        cannot be opened directly, the run is settled and the step goes on as
        `allocate_rows` would (`_leave_run`). `previous_rows`: (the id list of
        the step before, the rows of it these are) when the streak went on
        without some rows (`SchedulerOutput.previous_rows`); the run then goes
        on with the rows kept (`_narrowed_run`)."""
        run = self._decode_run(request_ids, starts, previous_rows)
        if run is None:
            return self.allocate_rows(rows)
        opened = self._open_run_blocks(run)
        if len(opened) < len(run.roomless):
            return self._leave_run(rows, run, run.roomless[:len(opened)], run.roomless[len(opened)])
        self._move_run(run, opened)
        return len(rows)

    def _open_run_blocks(self, run: DecodeRun) -> list[tuple]:
        """`_open_next_block` for the decode run's roomless rows, in order, their
        blocks taken from the pool in one call (in the order one call a row takes
        them); each row computes one token at its end (the run's caller vouches).
        Returns the rooms of the rows opened: those up to the first whose next
        block cannot be opened directly (`_opens_one_block`), or the pool runs short."""
        cut = len(self.pool.free_queue) // len(self.managers)
        request_ids = list(map(run.request_ids.__getitem__, run.roomless[:cut]))
        ends = run.roomless_ends[:cut]
        n = self._num_opening(request_ids, ends)
        if not n:
            return []
        return self._append_next_blocks(request_ids[:n], ends[:n], self.pool.get_new_blocks(n * len(self.managers)))

    def _num_opening(self, request_ids: list[str], ends: list[int]) -> int:
        """How many leading rows, each computing one token at its end, pass
        `_opens_one_block` (the pool's blocks for all of them: the caller's cut)."""
        if not self._opens_blocks:
            return 0
        n, size = len(ends), self.block_size
        for k, end in enumerate(ends):
            if end % size:
                n = k
                break
        totals = [end + 1 for end in ends]
        for manager in self.managers:
            n = manager.num_opening_one_block(request_ids[:n], totals[:n])
        return n

    def _append_next_blocks(self, request_ids: list[str], ends: list[int], blocks: list[KVBlock]) -> list[tuple]:
        """`_append_next_block` for each row (request_ids[k] at ends[k], a block
        boundary), row k's blocks being blocks[k * groups:(k + 1) * groups]: a
        group at a time, with no call a row (a crossing cost ~7 us a row in a
        served step on this project's CPU, 16 rows a step at 256 running and
        16-token blocks). Returns the rows' new rooms. The ends stay the decode
        run's to write (`_move_run`, `_leave_run`)."""
        groups, size = len(self.managers), self.block_size
        per_group = [blocks[g::groups] for g in range(groups)]
        for manager, group_blocks in zip(self.managers, per_group):
            manager.append_blocks(request_ids, group_blocks)
        all_tails = self._held.append_fresh_rows(request_ids, [end // size for end in ends], per_group)
        rooms = [(end + 1, end + size, tails, end + 1) for end, tails in zip(ends, all_tails)]
        self._room.update(zip(request_ids, rooms))
        return rooms

    def _decode_run(self, request_ids: list[str], starts: np.ndarray,
                    previous_rows: tuple[list[str], np.ndarray] | None = None) -> DecodeRun | None:
        """The run these rows continue, or a new one when the cache's ends are
        `starts` (None otherwise: the general path)."""
        run = self._run
        if run is not None and run.continues(request_ids, starts):
            return run
        run = self._narrowed_run(request_ids, starts, previous_rows)
        if run is not None:
            self._run = run
            return run
        self._settle()
        if self._drops_blocks or list(map(self._num_tokens.get, request_ids)) != starts.tolist():
            return None
        self._run = DecodeRun.start(request_ids, starts, list(map(self._room.get, request_ids)))
        return self._run

    def _narrowed_run(self, request_ids: list[str], starts: np.ndarray,
                      previous_rows: tuple[list[str], np.ndarray] | None) -> DecodeRun | None:
        """The run's rows `kept` (previous_rows: (its id list, kept)) as a new
        run, when their ends there are `starts`: a step whose running set
        changed (rows finished or left) reads the rows' ends and rooms from the
        run, not from the manager's dicts (2 x 256 lookups, ~45 us in a served
        step), and writes the ends of the rows left out only (a freed row's,
        -1, is gone: `_free_run_row`). The kept rows' ends go on lagging."""
        old = self._run
        if old is None or previous_rows is None or previous_rows[0] is not old.request_ids:
            return None
        kept = previous_rows[1]
        ends = old.ends[kept]
        if starts.data != ends.data:
            return None
        left_out = old.left_out(kept)
        if old.lagging:
            left_ends = old.ends[left_out].tolist()
            self._num_tokens.update((old.request_ids[i], end) for i, end in zip(left_out, left_ends) if end >= 0)
        return old.narrowed(request_ids, ends, left_out)

    def _move_run(self, run: DecodeRun, opened: list[tuple]) -> None:
        """Every row's end one further, as `_move_within_tail` moves one: the fill
        total by the tails of the rows that had a room (those `opened` this step,
        the roomless rows' new rooms, counted theirs when their blocks were
        added); rooms now full are left."""
        self._held.fill.used_slots += run.room_tails
        run.open_rooms(run.roomless, opened)
        filled = run.move(self.block_size)
        run.roomless, run.lagging = filled, True
        run.roomless_ends = self._leave_rooms(list(map(run.request_ids.__getitem__, filled)))
        run.close_rooms(filled)

    def _leave_rooms(self, request_ids: list[str]) -> list[int]:
        """`_leave_room` for each request, whose end is its room's last slot
        (`_num_tokens` may lag: a decode run's); returns those ends."""
        room_of, ends = self._room, []
        for request_id in request_ids:
            _, end, tails, counted = room_of.pop(request_id)
            moved = end - counted
            if moved:
                for fills in tails:  # one holder each: {slots: 1}
                    slots, count = fills.popitem()
                    fills[slots + moved] = count
            ends.append(end)
        return ends

    def _leave_run(self, rows: Sequence[tuple[Request, int, int]], run: DecodeRun,
                   opened: list[int], failed: int) -> int:
        """Row `failed` opens no block directly: settle the run (the rows
        `opened` this step are one further already), then finish the step row
        by row from there as the general decode path does."""
        self._run = None
        ends = run.ends.tolist()
        for i in opened:
            ends[i] += 1
        self._num_tokens.update(zip(run.request_ids, ends))
        done = self._open_roomless(rows, run.rooms, failed)
        self._move_rooms(run.request_ids[:done], run.ends[:done] + 1, run.rooms[:done])
        return done

    def _settle(self) -> None:
        """End the decode run, its ends written to `_num_tokens`: every call
        that may change a request's state besides the run's steps comes here
        first (the run's rooms and ends would no longer be the cache's), but
        `free`, which changes its own request's only (`_free_run_row`)."""
        self._write_ends()
        self._run = None

    def _free_run_row(self, request_id: str) -> None:
        """Before the request's blocks are freed: its end written, and its row,
        if the decode run has one, gone from the run (end -1: no start matches
        it, so the run goes on only without it, `_narrowed_run`). A free changes
        no other request's state, so the run need not be settled."""
        run = self._run
        if run is not None and request_id in run.request_ids:
            i = run.request_ids.index(request_id)
            if run.ends[i] >= 0:
                self._num_tokens[request_id] = int(run.ends[i])
                run.ends[i] = -1
                run.gone.append(request_id)

    def _write_ends(self) -> None:
        """`_num_tokens` up to the decode run's ends, the run going on: for
        readers that change nothing (`check_integrity`). Rows freed since
        (`_free_run_row`) have no end."""
        run = self._run
        if run is not None and run.lagging:
            self._num_tokens.update(zip(run.request_ids, run.ends.tolist()))
            for request_id in run.gone:
                del self._num_tokens[request_id]
            run.lagging = False

    def _open_roomless(self, rows: Sequence[tuple[Request, int, int]], rooms: list, first: int) -> int:
        """The one-token step of each row from `first` on whose room is None, in
        order, as `allocate_rows` takes it; the index of the first that fails,
        else len(rows)."""
        for i in compress(range(first, len(rows)), map(not_, rooms[first:])):
            request = rows[i][0]
            if not self._open_next_block(request, 1, 0) and not self.allocate_slots(request, 1):
                return i
        return len(rows)

    def _move_rooms(self, request_ids: list[str], totals: np.ndarray, rooms: list) -> None:
        """Set the ends to `totals`, one past them (rows without a room, None,
        are there already: `_open_roomless`), and move the fill total with
        them, as `_move_within_tail` does; a room whose tail is now full is left."""
        self._num_tokens.update(zip(request_ids, totals.tolist()))
        self._held.fill.used_slots += room_tails(rooms)
        for i in np.flatnonzero(totals % self.block_size == 0).tolist():
            room = rooms[i]
            if room is not None and room[1] == totals[i]:
                self._leave_room(request_ids[i])

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed: ComputedBlocks | None = None, reserve: int = 0) -> bool:
        """Whether `allocate_slots` with these arguments would succeed; changes nothing."""
        self._settle()
        hit = computed if computed is not None and computed.num_tokens > 0 else None
        if hit is not None:
            self._check_hit_usable(request, hit)
        first_query_pos = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        return self._can_allocate(request.request_id, hit, first_query_pos,
                                  first_query_pos + num_new_tokens, reserve)

    def _set_room(self, request_id: str, end: int) -> None:
        """Remember how far the request's end can move with nothing to do but
        move it (and cache the tail once it is full of known tokens): within its tail block
        (past it a block must be allocated: slow path), where every group's tail
        is held by this request alone and is not in the hash map (only cached
        blocks gain holders), and never in a model whose groups drop blocks as
        queries move. Checked first because it is what most decode steps are
        (hot path)."""
        index, slots = divmod(end, self.block_size)
        tails = None if self._drops_blocks or slots == 0 else self._held.sole_tails(request_id, index, slots)
        if tails is None or self._tail_is_cached(request_id, index):
            self._room.pop(request_id, None)
        else:
            self._room[request_id] = (index * self.block_size + 1, (index + 1) * self.block_size, tails, end)

    def _sync_tails(self, request_id: str) -> None:
        """Bring the room's tail fill counters up to the request's end: the
        decode fast path moves the end and the totals only (`_move_within_tail`).
        Anything that reads or changes a room's fill counters calls this first."""
        room = self._room.get(request_id)
        if room is None:
            return
        first, last, tails, counted = room
        moved = self._num_tokens[request_id] - counted
        if moved:
            for fills in tails:  # one holder each: {slots: 1}
                slots, count = fills.popitem()
                fills[slots + moved] = count
            self._room[request_id] = (first, last, tails, counted + moved)

    def _tail_is_cached(self, request_id: str, index: int) -> bool:
        """A tail block in the hash map (cached when full, then the end moved
        back: a step computed fewer tokens than scheduled) can gain holders
        through prefix hits, so it is no room of one request's."""
        return any(m.blocks(request_id)[index].block_hash is not None for m in self.managers)

    def _move_within_tail(self, request: Request, num_new_tokens: int) -> bool:
        """Move the end within the request's room (`_set_room`); False, changing
        nothing, when the new end is outside it. Every decode step of every
        request comes here, so it moves only the end and the fill totals: the
        tails' own counters catch up when the room is left (`_sync_tails`), not
        every step (touching them was a fifth of a 256-request schedule)."""
        request_id = request.request_id
        room = self._room.get(request_id)
        if room is None:
            return False
        first, last, tails, _ = room
        total = request.num_computed_tokens + num_new_tokens
        if not first <= total <= last:
            return False
        moved = total - self._num_tokens[request_id]
        if moved:
            self._held.fill.used_slots += moved * len(tails)
            self._num_tokens[request_id] = total
        if total == last:
            self._leave_room(request_id)
        return True

    def _leave_room(self, request_id: str) -> None:
        """The request's tail is full: the next token needs a new block (the
        full one is cached later: `_offer_deferred`)."""
        self._sync_tails(request_id)
        del self._room[request_id]

    def _open_next_block(self, request: Request, num_new_tokens: int, reserve: int) -> bool:
        """The general path's work, done directly, for the one token that opens
        the next block of every group (`_opens_one_block`): each group gets one
        fresh block, solely held, which becomes the room (`_set_room`). False,
        changing nothing, for any other allocation."""
        request_id = request.request_id
        end = self._num_tokens.get(request_id)
        total = request.num_computed_tokens + num_new_tokens
        if not self._opens_one_block(request_id, end, total, reserve):
            return False
        self._append_next_block(request_id, end, self.pool.get_new_blocks(len(self.managers)))
        return True

    def _append_next_block(self, request_id: str, end: int, blocks: list[KVBlock]) -> None:
        """Each group's table gains its fresh block of `blocks`, solely held, for the
        token at `end` (a block boundary), and the new block becomes the room."""
        self._append_next_blocks([request_id], [end], blocks)
        self._num_tokens[request_id] = end + 1

    def _opens_one_block(self, request_id: str, end: int | None, total: int, reserve: int) -> bool:
        """The end moves one token past a block boundary, no group drops blocks,
        the pool has a block per group, and each group's own policy asks for
        exactly that one (a compressed group holds NULL where no window ends)."""
        if end is None or total != end + 1 or len(self.managers) + reserve > len(self.pool.free_queue):
            return False
        return self._num_opening([request_id], [end]) == 1

    def _can_allocate(self, request_id: str, hit: ComputedBlocks | None,
                      first_query_pos: int, total: int, reserve: int = 0) -> bool:
        needed = 0
        for group_id, manager in enumerate(self.managers):
            hit_blocks = hit.blocks[group_id] if hit else ()
            needed += manager.num_new_blocks(request_id, total, len(hit_blocks))
            # A hit on a free block takes it out of the free queue; one on the
            # host needs a fresh block to load into.
            needed += sum(1 for b in hit_blocks
                          if b.on_host or (not b.is_null and b.ref_cnt == 0))
            if self._drops_blocks:
                needed -= manager.num_reclaimed(request_id, first_query_pos)
        return needed + reserve <= self.pool.num_free_blocks

    def _apply_allocation(self, request_id: str, hit: ComputedBlocks | None,
                          first_query_pos: int, total: int) -> None:
        # Phase order matters: hits are touched in every group before any group
        # reclaims free blocks, or a free hit block could be handed out as new.
        holds = request_id in self._num_tokens  # then no hit (_check_hit_usable)
        if hit is not None:
            self._add_hit(request_id, hit)
        if self._drops_blocks:  # no group drops blocks: nothing is skippable
            if holds:
                self._held.drop_skipped(request_id, first_query_pos, self._num_tokens[request_id])
            for manager in self.managers:
                manager.remove_skipped_blocks(request_id, first_query_pos)
        if holds:
            self._set_end(request_id, total)
        for manager in self.managers:
            manager.allocate_new_blocks(request_id, total)
        self._num_tokens[request_id] = total
        self._held.add_new(request_id, total)

    def _add_hit(self, request_id: str, hit: ComputedBlocks) -> None:
        """Give the request its hit blocks, loading the host ones into new GPU blocks."""
        refs = [(g, i, b) for g, group in enumerate(hit.blocks)
                for i, b in enumerate(group) if b.on_host]
        tables = [list(group) for group in hit.blocks]
        gpu_hits = [b for group in hit.blocks for b in group if not b.on_host]
        # A temporary reference keeps free GPU hits from being reclaimed for the loads.
        self.pool.touch(gpu_hits, count_hit=False)
        loaded = self._load_from_host([ref for _, _, ref in refs], [g for g, _, _ in refs])
        for (g, i, _), block in zip(refs, loaded):
            tables[g][i] = block
        for group_id, manager in enumerate(self.managers):
            manager.add_hit_blocks(request_id, tables[group_id], count_hit=not hit.is_swap_in)
            if hit.is_swap_in:  # offer the reloaded private blocks to the hash map again
                manager.num_cached_blocks[request_id] = _num_before_private(hit.blocks[group_id])
        self.pool.free_blocks(gpu_hits + loaded)

    def _load_from_host(self, refs: list[HostBlockRef], group_ids: list[int]) -> list[KVBlock]:
        if not refs:
            return []
        self.host_tier.pin(refs)  # the evictions below save to host: keep these slots
        blocks = self.pool.get_new_blocks(len(refs))
        for ref, group_id, block in zip(refs, group_ids, blocks):
            self.host_tier.load(ref, block.block_id)
            if ref.key is not None:
                self.pool.cache_block(block, group_id, ref.key[1], ref.content)
                block.num_hits = ref.num_hits
        self.host_tier.unpin(refs)
        return blocks

    def _check_hit_usable(self, request: Request, hit: ComputedBlocks) -> None:
        if request.request_id in self._num_tokens:
            raise ValueError(f"request {request.request_id!r} already holds blocks; "
                             f"pass a prefix hit only when admitting it")
        if hit.is_swap_in and request.request_id not in self._swapped:
            raise ValueError(f"request {request.request_id!r} was swapped in already")
        if hit.epoch == self._epoch():
            return
        token_ids = request.all_token_ids
        for manager, blocks in zip(self.managers, hit.blocks):
            for index, block in enumerate(blocks):
                if block.is_null or _is_private(block):  # private slots cannot vanish
                    continue
                if manager.lookup(request.block_hashes, token_ids, index) != block:
                    raise ValueError("stale prefix hit: call get_computed_blocks right "
                                     "before allocate_slots for the same request")

    def _offer_deferred(self, request: Request) -> None:
        """Cache the request's full blocks that its decode steps filled: the two
        direct decode paths (`_move_within_tail`, `_open_next_block`) leave them
        to this, called where they matter, when the request's blocks are freed
        or swapped (as SGLang's radix cache inserts a request's output when it
        finishes). Cached at the crossing, each block cost ~15 us of a decode
        step's host time on this project's CPU (16 crossings a step at 256
        running, block size 16); here a request's blocks are hashed in one walk.
        The general path (`_allocate`) still caches as blocks fill."""
        total = self._num_tokens.get(request.request_id)
        if self.enable_prefix_caching and total is not None:
            self._cache_full_blocks(request, total)

    def _num_full_known(self, request: Request, total: int) -> int:
        """Blocks of [0, total) full of tokens the host knows: those caching offers."""
        return min(total, len(request.prompt_token_ids) + len(request.output_token_ids)) // self.block_size

    def _cache_full_blocks(self, request: Request, total: int) -> None:
        num_full = self._num_full_known(request, total)
        request_id = request.request_id
        first = min([m.num_cached_blocks.get(request_id, 0) for m in self.managers])
        if first >= num_full:
            return
        contents = block_contents(request, first, num_full, self.block_size)
        for manager in self.managers:
            manager.cache_full_blocks(request_id, request.block_hashes, contents, first)

    # ---- release ------------------------------------------------------
    def free(self, request: Request) -> None:
        """Release all of a request's blocks (tail first), swapped ones included;
        unknown ids are a no-op. Full blocks its decode steps filled are offered
        to the hash map first (`_offer_deferred`)."""
        self._free_run_row(request.request_id)
        self._offer_deferred(request)
        self._free_gpu(request.request_id)
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            self.host_tier.release_private(swapped.slots())

    def _free_gpu(self, request_id: str) -> None:
        self._sync_tails(request_id)
        self._room.pop(request_id, None)
        self._held.forget(request_id, self._num_tokens.get(request_id, 0))
        for manager in self.managers:
            manager.free(request_id)
        self._num_tokens.pop(request_id, None)

    def _set_end(self, request_id: str, end: int) -> None:
        """Record the end of the request's computed+scheduled range."""
        self._held.move_end(request_id, self._num_tokens[request_id], end)
        self._num_tokens[request_id] = end

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing done) while requests hold blocks."""
        self._settle()
        if not self.pool.reset_prefix_cache():
            return False
        if self.host_tier is not None:
            self.host_tier.reset()
        return True

    # ---- swap -----------------------------------------------------------
    def _num_prefix_blocks(self, request: Request) -> int:
        """Leading blocks every group offered to the hash map, or will offer when
        it swaps out (`_offer_deferred`): a swap leaves them to the prefix cache
        instead of copying them."""
        if not self.enable_prefix_caching:
            return 0
        rid = request.request_id
        cached = min(m.num_cached_blocks.get(rid, 0) for m in self.managers)
        offered = max(cached, self._num_full_known(request, self._num_tokens.get(rid, 0)))
        return min(offered, request.num_computed_tokens // self.block_size)

    def _swap_tables(self, request: Request) -> list[list[KVBlock]]:
        """The blocks a swap copies, per group: those holding computed tokens
        past the cached prefix."""
        start = self._num_prefix_blocks(request)
        end = -(-request.num_computed_tokens // self.block_size)
        return [m.blocks(request.request_id)[start:end] for m in self.managers]

    def _num_swap_blocks(self, request: Request) -> int:
        return sum(1 for t in self._swap_tables(request) for b in t if not b.is_null)

    def swap_out_cost(self, request: Request) -> tuple[int, int]:
        """(bytes a swap-out moves, and again its swap-in; tokens a recompute
        would redo instead). Both leave out the cached prefix, which neither
        path loses while it stays in a tier."""
        self._settle()
        if self.host_tier is None:
            return 0, request.num_computed_tokens
        tail_tokens = request.num_computed_tokens - self._num_prefix_blocks(request) * self.block_size
        return self._num_swap_blocks(request) * self.host_tier.block_bytes, tail_tokens

    def can_swap_out(self, request: Request) -> bool:
        self._settle()
        if self.host_tier is None or request.num_computed_tokens == 0:
            return False
        return self._num_swap_blocks(request) <= self.host_tier.num_free_for_swap()

    def swap_out(self, request: Request) -> None:
        """Copy the request's computed KV past its cached prefix to private host
        slots and free its GPU blocks. Its next `get_computed_blocks` returns
        them after the prefix (see module doc)."""
        self._settle()
        if not self.can_swap_out(request):
            raise ValueError(f"request {request.request_id!r} cannot be swapped out")
        self._offer_deferred(request)
        num_prefix_tokens = self._num_prefix_blocks(request) * self.block_size
        tables = []
        for table in self._swap_tables(request):
            slots = iter(self.host_tier.swap_out([b.block_id for b in table if not b.is_null]))
            tables.append([b if b.is_null else HostBlockRef(next(slots), None, None) for b in table])
        self._free_gpu(request.request_id)
        self._swapped[request.request_id] = SwappedKV(tables, request.num_computed_tokens,
                                                      num_prefix_tokens)
        self.num_swap_outs += 1

    def take_pending_copies(self) -> CopyBatch:
        """Block copies queued since the last call (see `host_tier.py` for the order)."""
        return self.host_tier.take_pending() if self.host_tier is not None else CopyBatch()

    def host_metrics(self) -> dict[str, Any]:
        """Cache-side host-tier counters (the runner counts executed copies)."""
        host = self.host_tier
        return {"kv_host_hit_tokens": self.host_hit_tokens,
                "kv_host_swap_outs": self.num_swap_outs, "kv_host_swap_ins": self.num_swap_ins,
                "kv_host_swap_drops": self.num_swap_drops,
                "kv_host_write_backs": host.num_write_backs if host else 0,
                "kv_host_usage_perc": host.usage if host else 0.0,
                "kv_host_cached_blocks": host.num_cached if host else 0,
                "kv_host_evictions": host.num_evictions if host else 0,
                "num_requests_swapped": len(self._swapped)}

    # ---- introspection ------------------------------------------------
    def group_blocks(self) -> dict[str, int]:
        """Blocks held per KV group (a shared block once), keyed "g<id>:<spec>".
        One group holds every referenced block, a pool counter (O(1)); several
        groups walk their tables (metrics snapshots only, never the step path)."""
        if len(self.managers) == 1:
            return {f"g0:{self.managers[0].spec.describe()}": self.pool.num_blocks - 1 - self.num_free_blocks}
        return {f"g{g}:{m.spec.describe()}": self._distinct_held(m) for g, m in enumerate(self.managers)}

    @staticmethod
    def _distinct_held(manager) -> int:
        return len({b.block_id for table in manager.req_to_blocks.values() for b in table if not b.is_null})

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """Per group block table, NULL block (id 0) included: copies of a
        mirror kept where tables change, so a step does not walk blocks."""
        ids = self._held.block_ids(request_id)
        if ids is None:
            return [[] for _ in self.managers]
        return [table.copy() for table in ids]

    def block_tables(self, request_ids: list[str],
                     previous_rows: tuple[list[str], np.ndarray] | None = None) -> list[torch.Tensor]:
        """Per group, the requests' block tables as one [len(request_ids), W]
        int32 tensor padded with the null block: the step's batch tables,
        gathered from rows kept up to date where tables change.
        `previous_rows`: `SchedulerOutput.previous_rows` (`BlockTableRows.gather`)."""
        return self._held.rows.gather(request_ids, previous_rows)

    def num_blocks_needed(self, num_tokens: int, chunk_tokens: int = 1) -> int:
        """Peak blocks one request holds across groups to reach `num_tokens`,
        computing at most `chunk_tokens` per step (sliding groups stay bounded)."""
        return sum(m.max_blocks(num_tokens, chunk_tokens) for m in self.managers)

    def fragmentation(self) -> float:
        """Share of slots in held blocks that hold no computed/scheduled token.

        A block shared by several requests counts once, at its fullest; read
        from running counters (`block_fill.py`), O(1)."""
        return self._held.fill.fragmentation()

    def check_integrity(self) -> None:
        """Raise RuntimeError when ref counts, free queue and hash map disagree."""
        self._write_ends()
        refs: Counter[int] = Counter()
        for group_id, manager in enumerate(self.managers):
            for request_id, table in manager.req_to_blocks.items():
                ids = [block.block_id for block in table if not block.is_null]
                if len(ids) != len(set(ids)):
                    raise RuntimeError(f"request {request_id!r} holds a block twice "
                                       f"in group {group_id}: {ids}")
                refs.update(ids)
        if self.pool.null_block.ref_cnt != 0 or self.pool.null_block.block_hash is not None:
            raise RuntimeError("the NULL block was referenced or cached")
        self.pool.check_integrity(refs)
        for request_id in list(self._room):  # the counters the fast path left behind
            self._sync_tails(request_id)
        self._held.check(self._num_tokens)
        self._check_room()
        self._check_host_integrity()

    def _check_room(self) -> None:
        for request_id, (first, last, tails, _) in self._room.items():
            end, size = self._num_tokens.get(request_id), self.block_size
            if end is None or not first <= end < last or (first - 1) // size != (last - 1) // size \
                    or last % size != 0:
                raise RuntimeError(f"request {request_id!r}: fast-path room [{first}, {last}] is not "
                                   f"its tail block (end {end})")
            if tails != self._held.sole_tails(request_id, *divmod(end, self.block_size)):
                raise RuntimeError(f"request {request_id!r}: fast-path tail counters are stale")
            if self._tail_is_cached(request_id, end // size):
                raise RuntimeError(f"request {request_id!r}: fast-path room on a cached tail block")

    def _check_host_integrity(self) -> None:
        host = self.host_tier
        if host is None:
            if self._swapped:
                raise RuntimeError("swapped requests without a host tier")
            return
        for request_id in self._swapped:
            if request_id in self._num_tokens:
                raise RuntimeError(f"swapped request {request_id!r} also holds GPU blocks")
        host.check_integrity([s for kv in self._swapped.values() for s in kv.slots()])
        for key, entry in host.entries().items():
            block = self.pool.cached.get(key)
            if block is not None and block.content != entry.content:
                raise RuntimeError(f"{key} is cached on GPU and host with different contents")


def _is_private(block: HitBlock) -> bool:
    """A swapped-out request's own host slot (no cache key)."""
    return block.on_host and block.key is None


def _num_before_private(table: Sequence[HitBlock]) -> int:
    return next((i for i, b in enumerate(table) if _is_private(b)), len(table))
