"""`DecodeRun`: a decode streak's rows as the KV cache manager moves them.

A steady decode step moves every running request's end one token
(`KVCacheManager.allocate_decode_rows`). Done row by row through the
manager's dicts (each end, each room, the fill total over the rooms' tails),
that was ~60 us of dict and list passes at 256 rows on this project's CPU
with warm caches, ~130 us in a served step. While the scheduler's decode
streak holds (the same request-id list, step after step), the run keeps
those rows' ends in one array, their rooms in one list and the tails over
the rooms as one count, and touches a row's entries only when it crosses a
block boundary. The manager's per-request ends (`_num_tokens`) then lag
behind the array: any other call settles them first (`KVCacheManager._settle`).
When the streak goes on without some rows (they finished, or wait for their
last token), the next run is this one's kept rows (`narrowed`), read from
its arrays, not from the manager's dicts; a free takes its request's row out
of the run (`gone`) without settling the others (`KVCacheManager._narrowed_run`).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import compress
from operator import itemgetter, not_

import numpy as np

# A room's tail fill counters (the manager's `_set_room`), read in C over a step's rows.
_room_tails = itemgetter(2)


def without_rows(items: list, rows: list[int]) -> list:
    """A copy of `items` without the entries at `rows` (ascending): a step
    whose running set changed loses a few rows of 256, so deleting them from a
    copy (C memmoves) beats gathering the rest (~8 us a list at 256)."""
    kept = items.copy()
    for i in reversed(rows):
        del kept[i]
    return kept


def room_tails(rooms: list) -> int:
    """Tails over the rooms that exist (None: no room): the slots a step that
    moves each of their ends by one fills."""
    return sum(map(len, map(_room_tails, filter(None, rooms))))


@dataclass
class DecodeRun:
    request_ids: list[str]   # the streak's list: the same object every step of the run
    ends: np.ndarray         # int64: each row's end, which `_num_tokens` holds once settled
    rooms: list              # each row's room (the manager's `_room` entry) or None
    room_tails: int          # tails over the rows with a room: the slots one step fills
    roomless: list[int]      # rows without a room: each opens a block next step
    roomless_ends: list[int]  # their ends (read without numpy: a few rows a step)
    lagging: bool = False    # `_num_tokens` lags behind `ends`
    moves: int = 0           # steps the run moved every end one further (`move`)
    # Requests freed while the run holds (`KVCacheManager._free_run_row`): their ends are -1.
    gone: list[str] = field(default_factory=list)
    # From the second move on: the rows by end % block_size at that move (`_phases`).
    phases: list[list[int]] | None = None

    @classmethod
    def start(cls, request_ids: list[str], ends: np.ndarray, rooms: list) -> "DecodeRun":
        roomless = list(compress(range(len(rooms)), map(not_, rooms)))
        return cls(request_ids, ends.copy(), rooms, room_tails(rooms), roomless, ends[roomless].tolist())

    def left_out(self, kept: np.ndarray) -> list[int]:
        """The rows not in `kept`, in order."""
        left_out = np.ones(len(self.rooms), dtype=bool)
        left_out[kept] = False
        return np.flatnonzero(left_out).tolist()

    def narrowed(self, request_ids: list[str], ends: np.ndarray, left_out: list[int]) -> "DecodeRun":
        """A new run of this run's rows but those `left_out` (ascending, a few),
        `request_ids` and at `ends`, lagging as this one did. Everything is read
        from this run, touching the rows left out only: their rooms deleted from
        a copy of the list, their room tails taken off the count, and the
        roomless rows (this run's, a row without a room is one of them)
        renumbered past them (~25 us less than gathering the kept rows' rooms
        and finding the roomless among them, at 256 rows on this project's CPU)."""
        rooms = without_rows(self.rooms, left_out)
        gone = set(left_out)
        roomless = [i - bisect_left(left_out, i) for i in self.roomless if i not in gone]
        tails = self.room_tails - room_tails(list(map(self.rooms.__getitem__, left_out)))
        return DecodeRun(request_ids, ends, rooms, tails, roomless, ends[roomless].tolist(), self.lagging)

    def continues(self, request_ids: list[str], starts: np.ndarray) -> bool:
        """Whether a step of `request_ids` at `starts` is this run's next one.
        The arrays compare as memoryviews (shape and values, as
        `np.array_equal`), with no ufunc: ~20 us less with the caches cold."""
        return request_ids is self.request_ids and starts.data == self.ends.data

    def open_rooms(self, rows: list[int], rooms: list) -> None:
        """Rows without a room got one each, at its place in `rooms`."""
        self.room_tails += room_tails(rooms)
        for i, room in zip(rows, rooms):
            self.rooms[i] = room

    def close_rooms(self, rows: list[int]) -> None:
        """The rows' rooms were left."""
        self.room_tails -= room_tails(list(map(self.rooms.__getitem__, rows)))
        for i in rows:
            self.rooms[i] = None

    def move(self, block_size: int) -> list[int]:
        """Every end one further; returns the rows whose room holds its last
        slot now (their end on a block boundary), in order."""
        self.ends += 1
        self.moves += 1
        rooms = self.rooms
        return [i for i in self._on_boundary(block_size) if rooms[i] is not None]

    def _on_boundary(self, block_size: int) -> list[int]:
        """The rows whose end is on a block boundary, in order. The ends move
        together, so these are one residue class of the ends at any earlier
        move: a run that goes on indexes them once (at its second move) and
        then reads a list a step, not four numpy passes (~15 us cold)."""
        if self.moves == 1:   # most runs of a changing running set last one step
            return np.flatnonzero(self.ends % block_size == 0).tolist()
        if self.phases is None:
            self.phases = [[] for _ in range(block_size)]
            for i, end in enumerate(self.ends.tolist()):
                self.phases[(end - self.moves) % block_size].append(i)
        return self.phases[-self.moves % block_size]
