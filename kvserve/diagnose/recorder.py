"""RequestRecorder: what the engine knows about its traffic that no cache
counter says.

Reuse an unbounded prefix cache would get: every prompt's tokens are hashed
in `base`-token chunks at arrival (chained, like block hashes) against every
earlier prompt's chunks. The longest run of seen chunks is the prompt's
reusable prefix; at block size B a cache could hit `floor(run / B) * B` of it
(at most prompt - 1 tokens, as the engine computes at least one). Comparing
the cache's real hits with this says whether reuse was lost to eviction, to
caching being off, or to block granularity. The seen-chunk map is bounded
(oldest forgotten first) so memory stays flat on a long-running server.

It also keeps the last finished requests' timelines for the debug endpoint
and for offline records. A finish stores a few fields and a reference to the
request's event list (no copy, no dicts): the plain-data form is built only
when someone asks, so a step that finishes requests pays almost nothing.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvserve.request import Request

CANDIDATE_BLOCK_SIZES = (8, 16, 32, 64)
MAX_SEEN_CHUNKS = 1 << 18  # ~2M prompt tokens of history, ~40 MB
RECENT_REQUESTS = 512


class RequestRecorder:
    def __init__(self, block_size: int, max_seen: int = MAX_SEEN_CHUNKS,
                 recent: int = RECENT_REQUESTS) -> None:
        self.block_size = block_size
        self.base = math.gcd(block_size, 8)
        self.sizes = sorted({block_size, *(b for b in CANDIDATE_BLOCK_SIZES if b % self.base == 0)})
        self.max_seen = max_seen
        self._seen: dict[int, None] = {}
        self.num_arrivals = 0
        self.num_prompt_tokens = 0
        self.reusable_tokens = {b: 0 for b in self.sizes}
        self.recent: deque[FinishedRequest] = deque(maxlen=recent)

    def on_arrival(self, request: Request) -> None:
        tokens = request.prompt_token_ids
        run = self._observe_prefix(tokens, request.cache_salt)
        self.num_arrivals += 1
        self.num_prompt_tokens += len(tokens)
        for b in self.sizes:
            self.reusable_tokens[b] += min(run // b * b, (len(tokens) - 1) // b * b)

    def _observe_prefix(self, tokens: list[int], salt: str | None = None) -> int:
        """Tokens of `tokens` (whole chunks) already seen as an earlier prefix with the
        same cache salt (another salt's cannot be reused); records every chunk as seen."""
        # Python's tuple hash chains the chunks (3x cheaper than the cache's xxh3 of packed ids, whose
        # 128 bits guard real hits; an estimate can live with 64): an 8K-token prompt ~0.15 ms.
        parent, run, matching = (0 if salt is None else hash(("cache_salt", salt))), 0, True
        for start in range(0, len(tokens) - self.base + 1, self.base):
            parent = hash((parent, *tokens[start:start + self.base]))
            if matching and parent in self._seen:
                run += self.base
                continue
            matching = False
            self._seen[parent] = None
        if len(self._seen) > self.max_seen:  # forget the oldest quarter at once
            for key in list(self._seen)[:self.max_seen // 4]:
                del self._seen[key]
        return run

    def on_finished(self, request: Request) -> None:
        self.recent.append(FinishedRequest.of(request))

    def recent_requests(self) -> list[dict[str, Any]]:
        """The kept requests as plain data, oldest first. Safe from another
        thread: list() of a deque is one C call, and a finished request's
        fields no longer change."""
        return [r.as_record() for r in list(self.recent)]

    def recent_rows(self) -> list[list[Any]]:
        """The same as rows of FinishedRequest's fields: what the engine core
        sends, so the dicts are built on the API side, not between two steps."""
        return [r.row() for r in list(self.recent)]

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_requests_arrived": self.num_arrivals,
                               "prompt_tokens_arrived": self.num_prompt_tokens,
                               "prefix_reusable_tokens": self.reusable_tokens[self.block_size]}
        for b in self.sizes:
            out[f"prefix_reusable_tokens_bs{b}"] = self.reusable_tokens[b]
        return out


@dataclass(slots=True)
class FinishedRequest:
    """What a finished request's timeline needs, without its token lists."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    events: list[tuple[float, str, int]]   # the request's own list: nothing appends after finish

    @classmethod
    def of(cls, request: Request) -> "FinishedRequest":
        return cls(request.request_id, request.num_prompt_tokens, request.num_output_tokens,
                   max(request.num_cached_tokens, 0), request.num_preemptions, request.arrival_time,
                   request.first_token_time, request.finished_time, request.events)

    # The same merge the live request does, over the same field names.
    timeline = Request.timeline

    def row(self) -> list[Any]:
        return [self.request_id, self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens,
                self.num_preemptions, self.arrival_time, self.first_token_time, self.finished_time, self.events]

    def as_record(self) -> dict[str, Any]:
        return request_record(self)


def request_records(rows: list[list[Any]]) -> list[dict[str, Any]]:
    """`RequestRecorder.recent_rows()` (sent by the engine core) as plain data."""
    return [FinishedRequest(*row).as_record() for row in rows]


def request_record(request: Request | FinishedRequest) -> dict[str, Any]:
    """One finished request as plain data: ids, lengths, and its timeline."""
    return {"request_id": request.request_id, "prompt_tokens": request.num_prompt_tokens,
            "output_tokens": request.num_output_tokens,
            "cached_tokens": max(request.num_cached_tokens, 0),
            "num_preemptions": request.num_preemptions, "timeline": request.timeline()}
