"""The token-budget scheduler.

Scheduling is in tokens, not phases: every step, each scheduled request's
`num_computed_tokens` moves toward `num_tokens`. A decode is a request one
token behind, a prefill chunk is one many tokens behind, a prefix hit starts
it further along, and preemption by recompute sets it back to zero. The
scheduler reaches the KV cache only through `KVCacheManager`.

Policy: running requests first (oldest first), then waiting ones first come
first served, each computing at most `long_prefill_token_threshold` tokens a
step where that is set (vLLM's knob: a long prompt's chunks stay short beside
the decodes of their step). When blocks run out, the most recently admitted
running request is preempted, so the oldest always progresses and is never
starved. A victim is swapped out to the host tier instead of recomputed when
`PreemptionCosts` estimates the copies (out and back) cheaper than recomputing
its tokens; a swapped request is re-admitted like any other, its KV coming
back as a hit. Block copies the KV cache queued during a step travel in `kv_copies`.

Load-ahead admission: a waiting request whose hit must be loaded from the
host tier (a host hit or a swap-in), admitted while other requests run this
step, gets only its hit blocks now and is scheduled from the next step on.
Its copies, and those of every admission after it in this step (which wait
too, first come first served), travel in `kv_prefetch`: the runner starts
them now and only the next step's forward waits for them, so the load
overlaps this step's forward instead of stalling it.

KV rotation (`kv_rotation_interval` > 0): when the KV cache, not the token
budget, keeps the head of the queue waiting, requests that arrived together
would otherwise finish in waves, and the last wave decodes a few sequences at
the full weight-read cost of a step. So while fewer requests wait than run
(the tail of a burst; with a long queue the batch stays full anyway), every
`kv_rotation_interval` steps of such waiting the running request with the
most output tokens is preempted (swap or recompute, as above) and rejoins at
the back of the queue, so the head gets in; the batch stays full and all
requests finish close together. A victim must be ahead of the head by more
than one interval, so two requests never trade places back and forth.

Shared-prefix admission (`scheduling_policy="prefix"`, SGLang's longest-prefix
idea at the cost of one hash comparison per candidate): when the head does
not share its first block with a running request whose prompt is computed,
the first fresh (never preempted) request within `PREFIX_WINDOW` that does
goes first: its shared prefix is a hit on blocks already held, so it costs
no new blocks or compute and the batch holds more requests. (A holder still
in its chunked prefill has cached only its first chunks: a request let in
then would recompute the rest.) The head can be overtaken at most
`max_num_seqs` times, then it is admitted in order. Denser batches grow into
each other, so under this policy an admission must also leave one free block
per running request (each may cross a block boundary before the next
admission).

Steady decode: a step whose rows are every running request (but those whose
last token is in flight), each computing its one last token with its previous
token still on the device, leaves a `DecodeStreak`. If the launch advanced it
(`update_after_step`) and the next step finds the same running requests in the
same order, less those that finished or were aborted since (`finish` notes
them), each still with a token on the device, their state moved only as a
decode step moves it (computed +1, one more token sampled). Their rows are then
the streak's rows that can take another token, at the streak's starts plus one,
built without reading a request's other fields, and their KV is allocated over
arrays (`KVCacheManager.allocate_decode_rows`, with the ids the streak keeps).
When rows left, the step names the rows it keeps of the streak's step
(`SchedulerOutput.previous_rows`): the runner takes their pending tokens, and
the cache their block tables, from that step's. Anything else that changes a
running request (preemption, rotation, admission, a failed launch) changes the
running list otherwise or skips the advance, and the rows are read request by
request again.

Prompt logprobs: a prefix hit skips computing its positions, and with them
their logprobs, so a request asking for prompt logprobs takes a hit only over
positions whose logprobs it already has (re-admitted after a preemption, say);
otherwise it computes its whole prompt, uncounted as a prefix-cache query
(vLLM does the same). Its blocks are still cached for the requests after it.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat as _repeat
from operator import attrgetter, itemgetter
from typing import NamedTuple

import numpy as np

from kvserve.cache.decode_run import without_rows
from kvserve.cache.host_tier import CopyBatch
from kvserve.cache.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvserve.config import PREEMPTION_MODES, SchedulerConfig
from kvserve.request import Request, RequestStatus

# How far past the head the "prefix" policy looks for a request sharing a running one's prefix.
PREFIX_WINDOW = 128


class ScheduledRequest(NamedTuple):
    """One row of a step. A named tuple, not a dataclass: a decode step builds
    one per running request (`_tuple_new`: no Python __init__ per row), and its
    fields read in C."""

    request: Request
    num_new_tokens: int
    # num_computed_tokens before this step: the batch's first position.
    start_pos: int

    @property
    def completes_sequence(self) -> bool:
        """True when this step computes the last known token, so it samples."""
        return self.start_pos + self.num_new_tokens == self.request.num_tokens


@dataclass
class DecodeBatch:
    """A step's rows as arrays, when each computes its one last token (steady
    decode: it then samples, `completes_sequence`). Set by the scheduler
    only when it describes every row of the step."""

    starts: np.ndarray    # int64: each row's start_pos
    # Every row's token was sampled by the step in flight and is not on the
    # host yet (pipelined decode): the batch's ids are all PENDING_TOKEN.
    on_device: bool

    @property
    def num_rows(self) -> int:
        return len(self.starts)


class StreakStep(NamedTuple):
    """The rows a `DecodeStreak` gives the step after it, with what the scheduler
    keeps of them: their starts, the tokens each could still be given (this
    step's included), their request ids (the streak's own list while every row
    stays), and, when some rows left, the streak's id list with the rows of its
    step that stay (`SchedulerOutput.previous_rows`)."""

    rows: list[ScheduledRequest]
    requests: list[Request]
    starts: np.ndarray
    lefts: np.ndarray
    min_left: int
    request_ids: list[str]
    previous_rows: tuple[list[str], np.ndarray] | None
    num_idle: int   # running requests not in the rows: each has its last token in flight


@dataclass
class DecodeStreak:
    """The last steady decode step (module doc): its rows' requests, their
    starts, and the tokens each could still be given then, that step's one
    included (`lefts`)."""

    requests: list[Request]
    starts: np.ndarray
    lefts: np.ndarray        # int64, one a row
    min_left: int            # the fewest: while above 1, every row takes another token (no array pass)
    advanced: bool = False   # its launch ran `update_after_step` (the streak is always the last schedule's)
    # The requests' ids (read from them unless given), kept while the streak holds:
    # `KVCacheManager.allocate_decode_rows` and the batch's block tables take them.
    request_ids: list[str] | None = None

    def __post_init__(self) -> None:
        if self.request_ids is None:
            self.request_ids = list(map(_request_id_of, self.requests))

    def next_step(self, running: list[Request], budget: int, gone: Sequence[Request] = ()) -> StreakStep | None:
        """The step after it, or None unless the streak holds: advanced, the
        running requests its rows' (identity, in order) less those that left
        since (`gone`: finished or aborted), and those that can still take a
        token, at least one and within the budget, each with a token still on
        the device (a caller may resolve a step before the next one is
        launched: its tokens are then on the host). Its rows are those
        requests, each one token further; a row whose last token is in flight
        stays running without one."""
        if not self.advanced:
            return None
        same = running == self.requests
        if same and self.min_left > 1:   # steady: every row goes on
            return self._step(running, budget, running, self.request_ids, self.starts + 1, self.lefts - 1,
                              self.min_left - 1, None)
        keep = self.lefts > 1
        if not same:
            dropped = self._dropped(running, gone)
            if dropped is None:
                return None
            keep[dropped] = False
        kept = np.flatnonzero(keep)
        if not len(kept):
            return None
        left_out, lefts = np.flatnonzero(~keep).tolist(), self.lefts[kept] - 1
        return self._step(running, budget, without_rows(self.requests, left_out),
                          without_rows(self.request_ids, left_out), self.starts[kept] + 1, lefts, int(lefts.min()),
                          (self.request_ids, kept))

    @staticmethod
    def _step(running: list[Request], budget: int, requests: list[Request], ids: list[str], starts: np.ndarray,
              lefts: np.ndarray, min_left: int, previous: tuple | None) -> StreakStep | None:
        """The step of `requests` (of `running`) at `starts`, or None when the budget
        is short or a request's token is on the host."""
        if len(requests) > budget or not all(map(_pending_of, requests)):
            return None
        rows = list(map(_tuple_new, _repeat(ScheduledRequest), zip(requests, _repeat(1), starts.tolist())))
        return StreakStep(rows, requests, starts, lefts, min_left, ids, previous, len(running) - len(rows))

    def _dropped(self, running: list[Request], gone: Sequence[Request]) -> list[int] | None:
        """The indices of the streak's rows whose requests are `gone`, when
        `running` is the rows' requests less those (else None)."""
        index, dropped = self.requests.index, set()
        for request in gone:
            try:
                dropped.add(index(request))   # identity: Request compares by it
            except ValueError:
                pass   # not one of the rows (it waited, or left before the streak's step)
        if not dropped or len(running) + len(dropped) != len(self.requests):
            return None
        stay = list(self.requests)
        for i in sorted(dropped, reverse=True):
            del stay[i]
        return sorted(dropped) if stay == running else None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Every row as arrays, when each computes its one last token (steady decode).
    decode: DecodeBatch | None = None
    preempted: list[Request] = field(default_factory=list)
    # Must run before this step's forward (even if nothing is scheduled).
    kv_copies: CopyBatch = field(default_factory=CopyBatch)
    # Load-ahead admissions' copies: start now, after `kv_copies`; the next step's forward waits.
    kv_prefetch: CopyBatch = field(default_factory=CopyBatch)
    # The rows' request ids, when a decode streak kept them (else None: read them from the rows).
    request_ids: list[str] | None = None
    # When some of the streak's rows left: its id list (that of the step before, which
    # the step in flight keeps) and, per row of this step, its row in that step.
    previous_rows: tuple[list[str], np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class PreemptionCosts:
    """Swap or recompute a victim: seconds of copies against seconds of prefill.

    Rates start at the given estimates; the engine replaces them with measured
    ones (`observe`) once it has seen enough prefill and copies.
    """

    mode: str = "auto"
    copy_bytes_per_s: float = 25e9         # PCIe-class host link
    prefill_tokens_per_s: float = 10_000.0

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.mode!r}")

    def prefers_swap(self, swap_bytes: int, recompute_tokens: int) -> bool:
        if self.mode != "auto":
            return self.mode == "swap"
        # The KV crosses the link twice: out now, back in on resume.
        swap_s = 2 * swap_bytes / self.copy_bytes_per_s
        return swap_s < recompute_tokens / self.prefill_tokens_per_s

    def observe(self, prefill_tokens_per_s: float | None, copy_bytes_per_s: float | None) -> None:
        if prefill_tokens_per_s:
            self.prefill_tokens_per_s = prefill_tokens_per_s
        if copy_bytes_per_s:
            self.copy_bytes_per_s = copy_bytes_per_s


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 costs: PreemptionCosts | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.costs = costs if costs is not None else PreemptionCosts()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_rotations = 0
        self.num_load_ahead = 0
        self.num_prefix_overtakes = 0  # admissions ahead of the head ("prefix" policy)
        # Consecutive steps the queue's head waited for KV space (not budget).
        self._kv_blocked_steps = 0
        # (head, free blocks) when the head last failed for KV space: until blocks are
        # freed it still cannot fit, and its prefix lookup (a walk over both tiers) is skipped.
        self._blocked_head: tuple[Request, int] | None = None
        # First-block hashes of running requests past their prompt ("prefix"
        # policy), computed at most once per step.
        self._prefilled_prefixes: set[bytes] | None = None
        self._streak: DecodeStreak | None = None   # the last step's, while it was steady decode
        self._held_streak: StreakStep | None = None   # this step's rows, when a streak gave them
        self._lefts: list[int] = []   # per row, the tokens it could still be given (`_running_rows`)
        self._num_idle = 0   # running requests without a row, their last token in flight (`_running_rows`)
        self._gone: list[Request] = []   # requests finished since the last schedule (`DecodeStreak.next_step`)

    # -- queue management ------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free all its blocks."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.finish(request, RequestStatus.FINISHED_ABORTED)
                    return request
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        if self._streak is not None:   # the next schedule's streak may go on without it
            self._gone.append(request)
        request.status = status
        request.finished_time = time.monotonic()
        self.kv_cache.free(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._prefilled_prefixes = None
        rotated = self._maybe_rotate(out)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        deferred = False
        if len(out.preempted) == rotated:  # nobody was preempted for lack of blocks
            deferred = self._schedule_waiting(out, budget)
        if out.decode is not None and out.decode.num_rows != len(out.scheduled):
            out.decode = None  # admissions joined the decode rows
        if out.request_ids is not None and len(out.request_ids) != len(out.scheduled):
            out.request_ids = out.previous_rows = None  # admissions joined the streak's rows
        if deferred:
            out.kv_prefetch = self.kv_cache.take_pending_copies()
        else:
            out.kv_copies = self.kv_cache.take_pending_copies()
        self._streak = self._new_streak(out)
        self._gone = []
        return out

    def _new_streak(self, out: SchedulerOutput) -> DecodeStreak | None:
        """The step's streak when it is decode of every running request but those
        whose last token is in flight (steady only once `update_after_step` finds
        its tokens on the device: `advanced`)."""
        decode = out.decode
        if decode is None or out.preempted or len(out.scheduled) + self._num_idle != len(self.running):
            return None
        held = self._held_streak   # its rows are the step's: its requests and ids hold
        if held is not None:
            return DecodeStreak(list(held.requests), decode.starts, held.lefts, held.min_left,
                                request_ids=held.request_ids)
        requests = list(self.running) if not self._num_idle else list(map(_request_of, out.scheduled))
        return DecodeStreak(requests, decode.starts, np.array(self._lefts, dtype=np.int64), min(self._lefts))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests in order, each up to its known tokens, their KV
        allocated in one `allocate_rows` call. A step whose rows all compute
        their one last token (steady decode) also gets them as arrays
        (`SchedulerOutput.decode`): the batch is then built without walking
        the rows again."""
        rows, left, marks = self._running_rows(budget)
        num_candidates, streak = len(rows), self._held_streak
        starts = streak.starts if streak is not None else None
        out.scheduled = self._allocate_running(rows, out, streak)
        if len(rows) < num_candidates:  # rows of preempted requests were dropped
            left, starts = budget - sum(map(_num_new_of, rows)), None
        elif streak is not None:
            out.request_ids, out.previous_rows = streak.request_ids, streak.previous_rows
        out.decode = _decode_batch(rows, *marks, starts)
        return left

    def _running_rows(self, budget: int) -> tuple[list[ScheduledRequest], int, tuple[int, int]]:
        """A row for each running request that can grow, in order, with all
        the tokens it has left until the budget runs out; the budget left; and
        where the rows stop being decode rows (`_decode_batch`): the index of
        the first that does not compute its one last token, and of the first
        whose token the host already has (len(rows) when there is none)."""
        rows: list[ScheduledRequest] = []
        self._held_streak = None
        self._num_idle = 0
        if budget <= 0:
            return rows, budget, (0, 0)
        streak = self._streak
        held = streak.next_step(self.running, budget, self._gone) if streak is not None else None
        if held is not None:
            self._held_streak, self._num_idle = held, held.num_idle
            fast = held.rows
            return fast, budget - len(fast), (len(fast), len(fast))
        multi = known = None
        cap = self.config.long_prefill_token_threshold or budget
        append = rows.append
        lefts = self._lefts = []
        for request in self.running:  # hot loop: Request's properties inlined
            num_output, pending = len(request.output_token_ids), request.num_pending_tokens
            left = request.sampling_params.max_tokens - num_output - pending
            if left <= 0:  # not can_grow: its last token is in flight
                self._num_idle += 1
                continue
            lefts.append(left)
            start = request.num_computed_tokens
            num_left = len(request.prompt_token_ids) + num_output + pending - start
            if num_left != 1:
                multi = len(rows) if multi is None else multi
                num_left = min(num_left, cap)   # a prompt's chunk (a decode row computes 1)
            if not pending and known is None:
                known = len(rows)
            if num_left >= budget:  # the budget's last row
                append(_tuple_new(ScheduledRequest, (request, budget, start)))
                budget = 0
                break
            append(_tuple_new(ScheduledRequest, (request, num_left, start)))
            budget -= num_left
        end = len(rows)
        return rows, budget, (end if multi is None else multi, end if known is None else known)

    def _allocate_running(self, rows: list[ScheduledRequest], out: SchedulerOutput,
                          streak: StreakStep | None = None) -> list[ScheduledRequest]:
        """Allocate the rows' KV in order; where blocks run out, preempt the
        newest running requests until the row fits (`_preempt_until_fits`) and
        drop the rows of those preempted. Returns `rows`, cut to those kept.
        `streak`: the streak's step the rows are, which vouches for them (each
        computes one token at its request's num_computed_tokens, its `starts`)."""
        if streak is not None:
            done = self.kv_cache.allocate_decode_rows(rows, streak.request_ids, streak.starts, streak.previous_rows)
        else:
            done = self.kv_cache.allocate_rows(rows)
        while done < len(rows):
            request, num_new, _ = rows[done]
            if not self._preempt_until_fits(request, num_new, out):
                del rows[done:]  # `request` itself was preempted; everything after it too.
                break
            while rows[-1].request.status is RequestStatus.PREEMPTED:  # the newest: the rows' tail
                rows.pop()
            done = self.kv_cache.allocate_rows(rows, done + 1)
        return rows

    def _preempt_until_fits(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """`request`'s allocation failed: preempt the newest running requests
        until it succeeds; False once `request` itself was preempted."""
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
            if self.kv_cache.allocate_slots(request, num_new):
                return True

    def _preempt(self, request: Request, to_front: bool = True) -> None:
        """Release (swap or free) a running request's KV and requeue it: at the
        front (preempted for lack of blocks) or at the back (rotated out)."""
        if self._should_swap(request):
            self.kv_cache.swap_out(request)
            self.num_swap_preemptions += 1
        else:
            self.kv_cache.free(request)
        request.record_event("preempted", request.num_computed_tokens)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if to_front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _should_swap(self, request: Request) -> bool:
        return (self.costs.mode != "recompute" and self.kv_cache.can_swap_out(request)
                and self.costs.prefers_swap(*self.kv_cache.swap_out_cost(request)))

    def _maybe_rotate(self, out: SchedulerOutput) -> int:
        """KV rotation (module doc): preempt the running request furthest ahead
        of the waiting head, before this step schedules anyone; it rejoins at
        the back of the queue. Returns the number preempted (0 or 1)."""
        interval = self.config.kv_rotation_interval
        if not interval or not self.waiting or self._kv_blocked_steps < interval:
            return 0
        if len(self.waiting) >= len(self.running):
            return 0  # not the tail of a burst: the batch stays full without rotating
        head_progress = len(self.waiting[0].output_token_ids)
        candidates = [r for r in self.running if r.can_grow and r.output_token_ids
                      and len(r.output_token_ids) > head_progress + interval]
        if not candidates:
            return 0
        victim = max(candidates, key=lambda r: len(r.output_token_ids))
        self.running.remove(victim)
        self._preempt(victim, to_front=False)
        out.preempted.append(victim)
        self.num_rotations += 1
        self._kv_blocked_steps = 0
        return 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> bool:
        """Admit from the head of the queue; returns True when the step has
        load-ahead admissions (module doc)."""
        blocked = deferring = False
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting()
            if (self._blocked_head is not None and self._blocked_head[0] is request
                    and self.kv_cache.num_free_blocks <= self._blocked_head[1]):
                blocked = True
                break
            computed, num_hit = self.kv_cache.get_computed_blocks(request)
            skips_hit = _loses_prompt_logprobs(request, computed, num_hit)
            if skips_hit:
                computed, num_hit = ComputedBlocks([], 0), 0
            num_new = min(request.num_tokens - num_hit, budget, self.config.long_prefill_token_threshold or budget)
            if not deferring and out.scheduled and computed.num_host_blocks:
                out.kv_copies = self.kv_cache.take_pending_copies()  # what this forward waits for
                deferring = True
            # "prefix": leave a block per running request free (module doc).
            reserve = len(self.running) if self.config.scheduling_policy == "prefix" else 0
            if deferring:  # room for the whole admission, but only the hit is taken now
                admitted = (self.kv_cache.can_allocate(request, num_new, computed, reserve)
                            and self.kv_cache.allocate_slots(request, 0, computed))
            else:
                admitted = self.kv_cache.allocate_slots(request, num_new, computed, reserve)
            if not admitted:
                blocked = True
                self._blocked_head = (request, self.kv_cache.num_free_blocks)
                break  # First come first served: nobody overtakes the head.
            self._blocked_head = None
            if not skips_hit:
                self.kv_cache.record_prefix_lookup(request, num_hit, computed)
            self.waiting.popleft()
            self._admit(request, num_hit)
            if deferring:
                self.num_load_ahead += 1
            else:
                out.scheduled.append(ScheduledRequest(request, num_new, num_hit))
            budget -= num_new
        self._kv_blocked_steps = self._kv_blocked_steps + 1 if blocked else 0
        return deferring

    def _next_waiting(self) -> Request:
        """The request to admit next: the head, or under the "prefix" policy the
        first fresh request within `PREFIX_WINDOW` that shares its first block
        with a running request whose prompt is computed, moved to the front
        (module doc)."""
        head = self.waiting[0]
        if self.config.scheduling_policy != "prefix" or head.num_overtaken >= self.config.max_num_seqs:
            return head
        shared = self._shared_prefixes()
        if self.kv_cache.first_block_hash(head) in shared:
            return head
        for i in range(1, min(len(self.waiting), PREFIX_WINDOW)):
            request = self.waiting[i]
            if (request.num_preemptions == 0 and request.sampling_params.prompt_logprobs is None
                    and self.kv_cache.first_block_hash(request) in shared):
                head.num_overtaken += 1
                self.num_prefix_overtakes += 1
                del self.waiting[i]
                self.waiting.appendleft(request)
                return request
        return head

    def _shared_prefixes(self) -> set[bytes]:
        """First-block hashes of running requests whose prompt is computed: a
        request sharing one hits the whole shared prefix. One still in its
        prefill has cached only its first chunks, and a request let in then
        would recompute the rest itself."""
        if self._prefilled_prefixes is None:
            self._prefilled_prefixes = {
                h for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens
                and (h := self.kv_cache.first_block_hash(r)) is not None}
        return self._prefilled_prefixes

    def _admit(self, request: Request, num_hit: int) -> None:
        request.on_admitted(num_hit)
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def update_after_step(self, out: SchedulerOutput, sampled: Sequence[ScheduledRequest] = ()) -> None:
        """Advance computed tokens for what the forward pass just wrote, and
        count a pending token for each row of `sampled` (the launched step's
        sampling rows: their ids reach the host when the step resolves)."""
        rows = out.scheduled
        if out.decode is not None and out.decode.on_device and len(sampled) == len(rows):
            # Steady decode: every row samples and is past its prompt (no prefill
            # events), so one pass does both while each request is in cache.
            for request, num_new, start in rows:
                request.num_computed_tokens = start + num_new
                request.num_pending_tokens += 1
            if self._streak is not None:
                self._streak.advanced = True
            return
        for request, num_new, start in rows:
            request.num_computed_tokens = start + num_new
            if start < len(request.prompt_token_ids):  # a prompt chunk is an event; decode steps are too many
                request.record_event("prefill", num_new)
        for item in sampled:   # a long step's drain may have finished a row's request (it keeps none pending)
            if not item.request.is_finished:
                item.request.num_pending_tokens += 1

    def remove_finished(self, request: Request, status: RequestStatus) -> None:
        """Finish a request wherever it is: with pipelined steps, a stop can land
        after the request was preempted back to the waiting queue."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.num_pending_tokens = 0
        self.finish(request, status)


def _loses_prompt_logprobs(request: Request, computed: ComputedBlocks, num_hit: int) -> bool:
    """True when a hit would skip prompt positions whose logprobs the request
    still needs (module doc). Its own swapped-out blocks are no such hit."""
    if request.sampling_params.prompt_logprobs is None or computed.is_swap_in:
        return False
    return min(num_hit, request.num_prompt_tokens - 1) > len(request.prompt_logprobs)


def _decode_batch(rows: list[ScheduledRequest], multi: int, known: int,
                  starts: np.ndarray | None = None) -> DecodeBatch | None:
    """The rows as arrays when each computes its one last token (the first
    `multi` rows do), None otherwise; their tokens are on the device when
    the host has none of them (the first `known` rows). `starts`: the rows'
    start positions when the caller has them (a decode streak's)."""
    if not rows or multi < len(rows):
        return None
    if starts is None:
        starts = np.fromiter(map(_start_of, rows), dtype=np.int64, count=len(rows))
    return DecodeBatch(starts, on_device=known >= len(rows))


# ScheduledRequest(...) without its Python __new__ (nor a partial's call: slower still): the
# decode loop builds one per running request.
_tuple_new = tuple.__new__
# A row's fields, for C-level passes over a step's rows (`map`: no Python frame per row).
row_request_id = attrgetter("request.request_id")
_request_id_of = attrgetter("request_id")
_request_of = itemgetter(0)
_num_new_of = itemgetter(1)
_pending_of = attrgetter("num_pending_tokens")
_start_of = itemgetter(2)
