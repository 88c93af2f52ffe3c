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
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import itemgetter, not_

import numpy as np

# A room's tail fill counters (the manager's `_set_room`), read in C over a step's rows.
_room_tails = itemgetter(2)


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

    @classmethod
    def start(cls, request_ids: list[str], ends: np.ndarray, rooms: list) -> "DecodeRun":
        roomless = list(compress(range(len(rooms)), map(not_, rooms)))
        return cls(request_ids, ends.copy(), rooms, room_tails(rooms), roomless, ends[roomless].tolist())

    def continues(self, request_ids: list[str], starts: np.ndarray) -> bool:
        """Whether a step of `request_ids` at `starts` is this run's next one.
        The arrays compare as memoryviews (shape and values, as
        `np.array_equal`), with no ufunc: ~20 us less with the caches cold."""
        return request_ids is self.request_ids and starts.data == self.ends.data

    def set_rooms(self, rows: list[int], rooms: list) -> None:
        """Each of `rows`' room changed (opened, left, or set by the per-row
        path) to the one at its place in `rooms`."""
        self.room_tails += room_tails(rooms) - room_tails(list(map(self.rooms.__getitem__, rows)))
        for i, room in zip(rows, rooms):
            self.rooms[i] = room

    def filled(self, block_size: int) -> list[int]:
        """Rows whose room holds its last slot now (their end on a block boundary)."""
        return [i for i in np.flatnonzero(self.ends % block_size == 0).tolist() if self.rooms[i] is not None]
