"""The scheduler driven without a model: a stub engine loop samples a fixed
token for every request whose last known token was computed, and each test
compares the whole schedule (who runs, how many tokens, from which position,
who is preempted, what is freed) with a trace worked out by hand from the
policy in scheduler.py's module doc:

  - running requests first in admission order, then waiting ones first come
    first served, under the token budget and `max_num_seqs`;
  - out of blocks: the most recently admitted running request is preempted,
    its blocks freed (or swapped to the host tier when `PreemptionCosts`
    says the two copies cost less than recomputing), and it resumes from its
    prefix hit (recompute) or its swapped tokens (swap);
  - KV rotation: every `kv_rotation_interval` steps the head waits for KV,
    the request furthest ahead (by more than one interval) goes to the back.

Block counts are exact: 4-token blocks unless a test says otherwise, block 0
reserved, so `num_blocks=7` leaves 6 for requests.
"""
from __future__ import annotations

import pytest

from kvserve.cache.groups import make_kv_cache_groups
from kvserve.cache.host_tier import HostTier
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.specs import FullAttentionSpec
from kvserve.config import SchedulerConfig
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import PreemptionCosts, Scheduler

SAMPLED = 7  # the stub engine's token


def scheduler(num_blocks: int, *, block_size: int = 4, budget: int = 64, max_num_seqs: int = 8,
              rotation: int = 0, caching: bool = False, host: HostTier | None = None,
              costs: PreemptionCosts | None = None, policy: str = "fcfs", long_prefill: int = 0) -> Scheduler:
    kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), num_blocks, block_size,
                        enable_prefix_caching=caching, eviction_policy="lru", host_tier=host)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_model_len=512, kv_rotation_interval=rotation, scheduling_policy=policy,
                             long_prefill_token_threshold=long_prefill)
    return Scheduler(config, kv, costs)


def request(name: str, num_prompt: int, max_tokens: int = 8) -> Request:
    """A prompt of `num_prompt` tokens no other request shares (ids from the name)."""
    base = 1000 * (ord(name[0]) - ord("A") + 1)
    return Request(name, list(range(base, base + num_prompt)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler):
    """One engine step without pipelining: schedule, compute, sample, finish.
    Returns ([(id, num_new_tokens, start_pos)...], [preempted ids])."""
    out = s.schedule()
    s.update_after_step(out)
    for item in out.scheduled:
        if item.completes_sequence:
            r = item.request
            r.output_token_ids.append(SAMPLED)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                s.remove_finished(r, RequestStatus.FINISHED_LENGTH)
    return ([(i.request.request_id, i.num_new_tokens, i.start_pos) for i in out.scheduled],
            [r.request_id for r in out.preempted])


def run(s: Scheduler, expected: list) -> None:
    """Step through `expected` traces, one (scheduled, preempted) per step."""
    for number, want in enumerate(expected, 1):
        assert step(s) == want, f"step {number}"
        s.kv_cache.check_integrity()


# -- token budget and max_num_seqs -------------------------------------------------

def test_chunked_prefill_under_the_budget_and_the_sequence_cap():
    s = scheduler(64, budget=10, max_num_seqs=2)
    a, b, c = request("A", 7, 3), request("B", 6, 3), request("C", 3, 3)
    for r in (a, b, c):
        s.add_request(r)
    run(s, [
        ([("A", 7, 0), ("B", 3, 0)], []),  # B gets what is left of 10; C: budget spent
        ([("A", 1, 7), ("B", 3, 3)], []),  # 6 of the budget left, but two already run
        ([("A", 1, 8), ("B", 1, 6)], []),  # A's third token: it finishes
        ([("B", 1, 7), ("C", 3, 0)], []),
        ([("C", 1, 3)], []),
        ([("C", 1, 4)], []),
    ])
    assert not s.has_unfinished and s.kv_cache.num_free_blocks == 63
    assert [r.status for r in (a, b, c)] == [RequestStatus.FINISHED_LENGTH] * 3


def test_long_prefill_token_threshold_caps_each_requests_chunk():
    """vLLM's long_prefill_token_threshold: at most 4 tokens of one request a step, waiting or
    running, while the budget (10) would take more; decode rows are untouched."""
    s = scheduler(64, budget=10, long_prefill=4)
    a, b = request("A", 9, 2), request("B", 2, 3)
    for r in (a, b):
        s.add_request(r)
    run(s, [
        ([("A", 4, 0), ("B", 2, 0)], []),   # A capped at 4; B's whole prompt fits under it
        ([("A", 4, 4), ("B", 1, 2)], []),   # A's next chunk beside B's decode
        ([("A", 1, 8), ("B", 1, 3)], []),   # A's last prompt token; B finishes
        ([("A", 1, 9)], []),
    ])
    assert not s.has_unfinished


def test_long_prefill_token_threshold_must_not_be_negative():
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold must be >= 0 \(0: off\), got -1"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_step_output_totals():
    s = scheduler(64, budget=10)
    assert s.schedule().is_empty and not s.has_unfinished
    s.add_request(request("A", 7))
    s.add_request(request("B", 6))
    out = s.schedule()
    assert out.num_tokens == 10 and not out.is_empty
    assert [i.completes_sequence for i in out.scheduled] == [True, False]


def test_running_requests_spend_the_budget_first():
    s = scheduler(64, budget=2)
    for name in "ABC":
        s.add_request(request(name, 1, 2))
    run(s, [
        ([("A", 1, 0), ("B", 1, 0)], []),
        ([("A", 1, 1), ("B", 1, 1)], []),  # C still waits: the budget went to decodes
        ([("C", 1, 0)], []),
        ([("C", 1, 1)], []),
    ])
    assert not s.has_unfinished


def test_budget_left_after_decodes_goes_to_the_queue():
    s = scheduler(64, budget=4)
    s.add_request(request("A", 3))
    s.add_request(request("B", 3))
    run(s, [
        ([("A", 3, 0), ("B", 1, 0)], []),
        ([("A", 1, 3), ("B", 2, 1)], []),
        ([("A", 1, 4), ("B", 1, 3)], []),
    ])


def test_a_request_whose_last_token_is_in_flight_is_skipped_not_the_rest():
    """Pipelined engine: a request's final token sampled but not yet read
    back (num_pending_tokens) cannot grow; the requests after it still run."""
    s = scheduler(64)
    a, b = request("A", 3, max_tokens=1), request("B", 2, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    s.update_after_step(s.schedule())
    a.num_pending_tokens = b.num_pending_tokens = 1  # what the engine does for sampled rows
    out = s.schedule()
    assert [(i.request.request_id, i.num_new_tokens, i.start_pos) for i in out.scheduled] == [("B", 1, 2)]
    assert out.scheduled[0].completes_sequence


# -- preemption by recompute ---------------------------------------------------------

def test_preemption_takes_the_latest_admitted_and_resume_recomputes_everything():
    """6 usable blocks; three 8-token prompts hold 2 each. The first decode
    needs a third block for A: C (admitted last) is preempted, its 2 blocks
    go to A and B. C resumes once A and B finish, recomputing its 8 prompt
    tokens and the token it had sampled (9)."""
    s = scheduler(7)
    a, b, c = request("A", 8, 5), request("B", 8, 5), request("C", 8, 5)
    for r in (a, b, c):
        s.add_request(r)
    assert step(s) == ([("A", 8, 0), ("B", 8, 0), ("C", 8, 0)], [])
    assert s.kv_cache.num_free_blocks == 0
    assert step(s) == ([("A", 1, 8), ("B", 1, 8)], ["C"])
    assert s.kv_cache.num_free_blocks == 0
    assert list(s.waiting) == [c] and s.running == [a, b]
    assert (c.status, c.num_computed_tokens, c.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert c.output_token_ids == [SAMPLED]  # its sampled token is kept
    assert (s.num_preemptions, s.num_swap_preemptions) == (1, 0)
    assert ("preempted", 8) in [(e, n) for _, e, n in c.events]
    run(s, [
        ([("A", 1, 9), ("B", 1, 9)], []),  # C needs 3 blocks, none free
        ([("A", 1, 10), ("B", 1, 10)], []),
        ([("A", 1, 11), ("B", 1, 11)], []),  # both finish: 6 blocks free
    ])
    assert s.kv_cache.num_free_blocks == 6
    assert step(s) == ([("C", 9, 0)], [])
    assert s.kv_cache.num_free_blocks == 3 and c.status == RequestStatus.RUNNING
    assert ("resumed", 0) in [(e, n) for _, e, n in c.events]
    run(s, [([("C", 1, 9)], []), ([("C", 1, 10)], []), ([("C", 1, 11)], [])])
    assert not s.has_unfinished and s.kv_cache.num_free_blocks == 6
    assert s.num_preemptions == 1


def test_resume_recomputes_only_past_the_blocks_still_cached():
    """Prefix caching, LRU: 7 usable blocks, three 8-token prompts hold 2
    each. A's third block is the one never used; B's preempts C, whose blocks
    are freed tail first, so B reclaims C's tail and C's first block stays
    cached. C resumes with a 4-token hit and recomputes 9 - 4 = 5 tokens."""
    s = scheduler(8, caching=True)
    a, b, c = request("A", 8, 5), request("B", 8, 5), request("C", 8, 5)
    for r in (a, b, c):
        s.add_request(r)
    run(s, [
        ([("A", 8, 0), ("B", 8, 0), ("C", 8, 0)], []),
        ([("A", 1, 8), ("B", 1, 8)], ["C"]),
    ])
    assert s.kv_cache.num_free_blocks == 1 and s.kv_cache.num_evictions == 1
    run(s, [
        ([("A", 1, 9), ("B", 1, 9)], []),  # C: 2 new blocks + its free cached one > 1 free
        ([("A", 1, 10), ("B", 1, 10)], []),
        ([("A", 1, 11), ("B", 1, 11)], []),
        ([("C", 5, 4)], []),
    ])
    assert c.num_cached_tokens == 0  # the first admission's hit, not the resume's
    assert s.kv_cache.prefix_cache_hits == 4
    assert s.kv_cache.prefix_cache_queries == 8 * 3 + 9


def test_the_request_needing_a_block_can_be_its_own_victim():
    """A (admitted first) fits its next token; B needs a second block and is
    the most recently admitted: B preempts itself, A still runs."""
    s = scheduler(4)  # 3 usable
    a, b = request("A", 6, 3), request("B", 4, 3)
    s.add_request(a)
    s.add_request(b)
    run(s, [
        ([("A", 6, 0), ("B", 4, 0)], []),
        ([("A", 1, 6)], ["B"]),
    ])
    assert s.kv_cache.num_free_blocks == 1 and list(s.waiting) == [b]
    run(s, [
        ([("A", 1, 7)], []),  # B (5 tokens, 2 blocks) does not fit in 1; A finishes
        ([("B", 5, 0)], []),
    ])


def test_no_admission_in_a_step_that_preempted():
    """A step that ran out of blocks admits nobody, even a request that
    would fit in what the victim freed."""
    s = scheduler(4)  # 3 usable
    a, b = request("A", 4, 3), request("B", 4, 3)
    s.add_request(a)
    s.add_request(b)
    assert step(s) == ([("A", 4, 0), ("B", 4, 0)], [])
    s.add_request(request("C", 1, 3))  # one block: 1 free
    assert step(s) == ([("A", 1, 4)], ["B"])  # A takes the free block, B preempts itself
    assert [r.request_id for r in s.waiting] == ["B", "C"]  # B at the front


# -- aborts and finishing ------------------------------------------------------------

def test_a_blocked_head_that_leaves_does_not_block_the_next():
    """H (3 blocks) cannot fit in the 2 free blocks, so S behind it waits
    (first come first served). H is aborted: S is the head now and fits."""
    s = scheduler(4)  # 3 usable
    s.add_request(request("A", 2))
    s.add_request(request("H", 12))
    s.add_request(request("S", 4))
    assert step(s) == ([("A", 2, 0)], [])
    assert s.abort_request("H") is not None
    assert step(s) == ([("A", 1, 2), ("S", 4, 0)], [])


def test_abort_frees_blocks_wherever_the_request_is():
    s = scheduler(4)  # 3 usable
    a, b = request("A", 8), request("B", 8)
    s.add_request(a)
    s.add_request(b)
    step(s)  # A holds 2 blocks, B waits
    assert s.abort_request("nobody") is None
    assert s.abort_request("B") is b and b.status == RequestStatus.FINISHED_ABORTED
    assert s.kv_cache.num_free_blocks == 1 and not s.waiting
    assert s.abort_request("A") is a and a.status == RequestStatus.FINISHED_ABORTED
    assert a.finished_time is not None
    assert s.kv_cache.num_free_blocks == 3 and not s.has_unfinished


def test_a_stop_landing_after_preemption_finishes_the_waiting_request():
    s = scheduler(7)
    reqs = [request(n, 8, 5) for n in "ABC"]
    for r in reqs:
        s.add_request(r)
    run(s, [([("A", 8, 0), ("B", 8, 0), ("C", 8, 0)], []), ([("A", 1, 8), ("B", 1, 8)], ["C"])])
    c = reqs[2]
    c.num_pending_tokens = 1
    s.remove_finished(c, RequestStatus.FINISHED_STOPPED)
    assert c not in s.waiting and c.num_pending_tokens == 0 and c.status == RequestStatus.FINISHED_STOPPED
    s.remove_finished(reqs[0], RequestStatus.FINISHED_STOPPED)
    assert s.running == [reqs[1]] and s.kv_cache.num_free_blocks == 3


def test_admission_sets_running_state_once():
    s = scheduler(64)
    a = request("A", 5)
    s.add_request(a)
    assert s.has_unfinished and a.status == RequestStatus.WAITING
    step(s)
    assert a.status == RequestStatus.RUNNING and a.num_cached_tokens == 0
    first = a.first_scheduled_time
    assert first is not None
    step(s)
    assert a.first_scheduled_time == first
    assert [(e, n) for _, e, n in a.events] == [("scheduled", 0), ("prefill", 5)]


# -- KV rotation -----------------------------------------------------------------------

def test_rotation_lets_the_queue_head_in_every_interval():
    """16-token blocks, 3 usable: every request fits one block for life, so
    only rotation moves the queue. Interval 2: D waits from step 3, so at
    step 5 the furthest request (A, 4 outputs > 0 + 2) goes to the back and D
    gets its block. A (4 outputs) then heads the queue: B needs more than
    4 + 2 outputs, which it has at step 9 (7), not at step 8 (exactly 6)."""
    s = scheduler(4, block_size=16, rotation=2)
    a, b, c, d = (request(n, 4, 12) for n in "ABCD")
    s.add_request(a)
    assert step(s) == ([("A", 4, 0)], [])
    s.add_request(b)
    assert step(s) == ([("A", 1, 4), ("B", 4, 0)], [])
    s.add_request(c)
    s.add_request(d)
    run(s, [
        ([("A", 1, 5), ("B", 1, 4), ("C", 4, 0)], []),  # D blocked: 1 step
        ([("A", 1, 6), ("B", 1, 5), ("C", 1, 4)], []),  # 2 steps, rotation from the next
        ([("B", 1, 6), ("C", 1, 5), ("D", 4, 0)], ["A"]),
    ])
    assert list(s.waiting) == [a] and a.num_computed_tokens == 0 and a.num_output_tokens == 4
    assert (s.num_rotations, s.num_preemptions) == (1, 1)
    run(s, [
        ([("B", 1, 7), ("C", 1, 6), ("D", 1, 4)], []),  # A has waited 2 steps now
        ([("B", 1, 8), ("C", 1, 7), ("D", 1, 5)], []),
        ([("B", 1, 9), ("C", 1, 8), ("D", 1, 6)], []),  # B has 6 = 4 + 2 outputs: not yet
        ([("C", 1, 9), ("D", 1, 7), ("A", 8, 0)], ["B"]),  # A takes B's block
    ])
    assert list(s.waiting) == [b] and s.num_rotations == s.num_preemptions == 2
    assert a.num_preemptions == 1 and b.status == RequestStatus.PREEMPTED


def test_rotations_swap_and_resume_where_they_stopped():
    """Four requests, room for three, rotation every step, swap forced: every
    preemption is a rotation and a swap, and every resume computes from the
    token count the request had when it left (its swapped KV is the hit).
    Requests rotate more than once; all counters agree."""
    s = scheduler(4, block_size=32, rotation=1, host=HostTier(8, block_bytes=10),
                  costs=PreemptionCosts("swap"))
    reqs = [request(n, 4, 24) for n in "ABCD"]
    for r in reqs:
        s.add_request(r)
    left_at: dict[str, int] = {}
    resumes = 0
    for _ in range(200):
        if not s.has_unfinished:
            break
        scheduled, preempted = step(s)
        for rid, num_new, start in scheduled:
            if rid in left_at:
                assert start == left_at.pop(rid) and num_new == 1, rid
                resumes += 1
        for rid in preempted:
            left_at[rid] = [n for _, e, n in s_request(reqs, rid).events if e == "preempted"][-1]
    assert not s.has_unfinished and all(r.num_output_tokens == 24 for r in reqs)
    assert resumes == s.num_rotations == s.num_preemptions == s.num_swap_preemptions
    assert sum(r.num_preemptions for r in reqs) == s.num_preemptions
    assert max(r.num_preemptions for r in reqs) >= 2
    assert s.kv_cache.num_swap_outs == s.kv_cache.num_swap_ins == s.num_preemptions
    assert 2 <= s.num_load_ahead <= resumes  # resumes while others ran were loaded ahead


def s_request(reqs: list[Request], rid: str) -> Request:
    return next(r for r in reqs if r.request_id == rid)


def test_rotated_request_goes_behind_the_waiting_ones():
    """Two wait, three run (the tail of a burst): the rotated request rejoins
    at the back, behind both."""
    s = scheduler(4, block_size=16, rotation=1)
    reqs = {n: request(n, 4, 12) for n in "ABCDE"}
    for n in "ABC":
        s.add_request(reqs[n])
    run(s, [([("A", 4, 0), ("B", 4, 0), ("C", 4, 0)], [])])
    for _ in range(2):
        step(s)
    s.add_request(reqs["D"])
    s.add_request(reqs["E"])
    assert step(s)[1] == []  # D blocked one step
    scheduled, preempted = step(s)  # everyone has 4 outputs: ties go to the first admitted
    assert len(preempted) == 1 and preempted[0] in "ABC"
    assert [r.request_id for r in s.waiting] == ["E", preempted[0]]
    assert scheduled[-1] == ("D", 4, 0)


def test_the_wait_count_restarts_after_a_rotation():
    """Interval 2, two waiting. A is rotated at step 5 and D gets in; E still
    waits, but its count starts again: 1 after step 5, so no rotation at
    step 6 (B, 4 outputs, would be a candidate) and B goes at step 7."""
    s = scheduler(4, block_size=16, rotation=2)
    reqs = {n: request(n, 4, 12) for n in "ABCDE"}
    s.add_request(reqs["A"])
    assert step(s) == ([("A", 4, 0)], [])
    s.add_request(reqs["B"])
    assert step(s) == ([("A", 1, 4), ("B", 4, 0)], [])
    for n in "CDE":
        s.add_request(reqs[n])
    run(s, [
        ([("A", 1, 5), ("B", 1, 4), ("C", 4, 0)], []),
        ([("A", 1, 6), ("B", 1, 5), ("C", 1, 4)], []),
        ([("B", 1, 6), ("C", 1, 5), ("D", 4, 0)], ["A"]),
        ([("B", 1, 7), ("C", 1, 6), ("D", 1, 4)], []),
        ([("C", 1, 7), ("D", 1, 5), ("E", 4, 0)], ["B"]),
    ])
    assert [r.request_id for r in s.waiting] == ["A", "B"] and s.num_rotations == 2


def test_no_rotation_candidate_still_lets_the_head_in_when_blocks_free_up():
    """D was preempted before with 5 outputs; nobody running is more than one
    interval (1) ahead of it, so nobody is rotated, but the queue is still
    served: when A finishes (step 3), D takes its block at step 4 and
    recomputes its 4 + 5 tokens."""
    s = scheduler(4, block_size=16, rotation=1)
    a, b, c = request("A", 4, 3), request("B", 4, 12), request("C", 4, 12)
    d = request("D", 4, 12)
    d.output_token_ids.extend([SAMPLED] * 5)
    for r in (a, b, c, d):
        s.add_request(r)
    run(s, [
        ([("A", 4, 0), ("B", 4, 0), ("C", 4, 0)], []),
        ([("A", 1, 4), ("B", 1, 4), ("C", 1, 4)], []),
        ([("A", 1, 5), ("B", 1, 5), ("C", 1, 5)], []),  # A finishes
        ([("B", 1, 6), ("C", 1, 6), ("D", 9, 0)], []),
    ])
    assert s.num_rotations == 0


def test_no_rotation_while_the_queue_is_as_long_as_the_batch():
    """One runs, one waits: not the tail of a burst, so B waits for A to finish."""
    s = scheduler(2, block_size=16, rotation=1)  # 1 usable block
    s.add_request(request("A", 4, 6))
    s.add_request(request("B", 4, 2))
    run(s, [([("A", 4, 0)], [])] + [([("A", 1, p)], []) for p in range(4, 9)] + [([("B", 4, 0)], [])])
    assert s.num_rotations == 0 and s.num_preemptions == 0


def test_no_rotation_when_the_budget_not_the_cache_keeps_the_head_waiting():
    s = scheduler(64, block_size=16, budget=2, rotation=1)
    for n in "ABC":
        s.add_request(request(n, 1, 6))
    for _ in range(6):
        assert step(s)[1] == []
    assert s.num_rotations == 0


def test_a_request_with_its_last_token_in_flight_is_not_rotated():
    """Rotation candidates must still be able to grow: A (furthest ahead,
    4 outputs of 5) has its final token in flight, so B (3) is rotated."""
    s = scheduler(3, block_size=16, rotation=1)  # 2 usable
    a, b, c = request("A", 4, 5), request("B", 4, 9), request("C", 4, 9)
    s.add_request(a)
    assert step(s) == ([("A", 4, 0)], [])
    s.add_request(b)
    run(s, [([("A", 1, 4), ("B", 4, 0)], []), ([("A", 1, 5), ("B", 1, 4)], [])])
    s.add_request(c)
    assert step(s) == ([("A", 1, 6), ("B", 1, 5)], [])  # C blocked: 1 step
    a.num_pending_tokens = 1  # A's fifth token sampled, not yet read back
    assert step(s) == ([("C", 4, 0)], ["B"])  # A cannot grow: skipped, not rotated
    assert list(s.waiting) == [b] and s.running == [a, c]


# -- swap or recompute -------------------------------------------------------------------

@pytest.mark.parametrize("swap_bytes, tokens, copy_rate, prefill_rate, swap", [
    (1000, 3, 1e6, 1000.0, True),    # out and back: 2 ms of copies < 3 ms of prefill
    (1000, 2, 1e6, 1000.0, False),   # 2 ms each: a tie recomputes
    (1000, 1, 1e6, 1000.0, False),
    (4000, 9, 1e6, 1000.0, True),    # 8 ms < 9 ms
    (4000, 8, 1e6, 1000.0, False),
    (0, 1, 1e6, 1000.0, True),       # nothing to copy
    (3000, 7, 2e6, 2000.0, True),    # 3 ms < 3.5 ms
    (3000, 5, 2e6, 2000.0, False),   # 3 ms > 2.5 ms
])
def test_prefers_swap_compares_both_copies_with_the_prefill(swap_bytes, tokens, copy_rate, prefill_rate, swap):
    costs = PreemptionCosts("auto", copy_bytes_per_s=copy_rate, prefill_tokens_per_s=prefill_rate)
    assert costs.prefers_swap(swap_bytes, tokens) is swap


def test_forced_modes_ignore_the_costs():
    assert PreemptionCosts("swap").prefers_swap(10**12, 1) is True
    assert PreemptionCosts("recompute").prefers_swap(0, 10**9) is False


def test_default_rates_are_a_pcie_link_and_ten_thousand_tokens_a_second():
    costs = PreemptionCosts()
    assert costs.mode == "auto"
    # 25 GB/s, both ways, vs 10k tokens/s: 1.25 MB per token is the break-even.
    assert costs.prefers_swap(1_249_999, 1) and not costs.prefers_swap(1_250_000, 1)


def test_observe_replaces_rates_only_with_measurements():
    costs = PreemptionCosts("auto", copy_bytes_per_s=1e6, prefill_tokens_per_s=1000.0)
    costs.observe(None, None)
    costs.observe(0.0, 0.0)
    assert (costs.prefill_tokens_per_s, costs.copy_bytes_per_s) == (1000.0, 1e6)
    costs.observe(4000.0, None)
    assert (costs.prefill_tokens_per_s, costs.copy_bytes_per_s) == (4000.0, 1e6)
    costs.observe(None, 3e6)
    assert (costs.prefill_tokens_per_s, costs.copy_bytes_per_s) == (4000.0, 3e6)


def test_unknown_preemption_mode_names_the_choices():
    with pytest.raises(ValueError, match=r"preemption_mode must be one of auto, swap, recompute, got 'fast'"):
        PreemptionCosts("fast")


def _swap_scenario(costs: PreemptionCosts, host_slots: int = 8) -> tuple[Scheduler, list[Request]]:
    """6 usable blocks, three 8-token prompts; C is preempted at step 2 with
    8 computed tokens in 2 blocks (no prefix caching: all of them are copied)."""
    s = scheduler(7, host=HostTier(host_slots, block_bytes=1000), costs=costs)
    reqs = [request("A", 8, 3), request("B", 8, 5), request("C", 8, 5)]
    for r in reqs:
        s.add_request(r)
    assert step(s)[0] == [("A", 8, 0), ("B", 8, 0), ("C", 8, 0)]
    return s, reqs


def test_swap_out_and_load_ahead_resume():
    """C's swap: 2 blocks x 1000 bytes, twice over 1 MB/s = 4 ms, against
    8 tokens at 1000/s = 8 ms: swapped. It resumes when A finishes (step 3)
    with its 8 tokens as a hit: B runs in that step, so C only takes its hit
    blocks (the 2 loads travel as a prefetch) and computes 1 token from
    position 8 in the next step."""
    s, (a, b, c) = _swap_scenario(PreemptionCosts("auto", 1e6, 1000.0))
    c_blocks = s.kv_cache.get_block_ids("C")[0]
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["C"]
    assert [(x.to_host, x.gpu_block) for x in out.kv_copies.copies] == [(True, i) for i in c_blocks]
    assert not out.kv_prefetch
    assert (s.num_swap_preemptions, s.kv_cache.num_swap_outs, s.num_preemptions) == (1, 1, 1)
    assert c.num_computed_tokens == 0 and s.kv_cache.get_block_ids("C") == [[]]
    s.update_after_step(out)
    for item in out.scheduled:  # A and B sample
        item.request.output_token_ids.append(SAMPLED)
    assert step(s) == ([("A", 1, 9), ("B", 1, 9)], [])  # A finishes: 3 blocks free
    out = s.schedule()
    assert [(i.request.request_id, i.num_new_tokens, i.start_pos) for i in out.scheduled] == [("B", 1, 10)]
    assert s.num_load_ahead == 1 and s.running == [b, c] and c.num_computed_tokens == 8
    assert s.kv_cache.num_free_blocks == 1  # 3 free, 2 taken by the loads; C's third block comes next step
    assert not out.kv_copies.copies
    assert [x.to_host for x in out.kv_prefetch.copies] == [False, False]
    assert s.kv_cache.num_swap_ins == 1
    s.update_after_step(out)
    b.output_token_ids.append(SAMPLED)
    assert step(s)[0] == [("B", 1, 11), ("C", 1, 8)]
    assert b.is_finished and s.kv_cache.num_free_blocks == 6 - 3  # C holds 3


def test_default_costs_swap_a_small_victim():
    """Default rates (25 GB/s, 10k tokens/s): 2 blocks of 1000 bytes out and
    back take 0.16 us, recomputing 8 tokens 0.8 ms: C is swapped."""
    s = scheduler(7, host=HostTier(8, block_bytes=1000))
    for r in (request("A", 8, 3), request("B", 8, 5), request("C", 8, 5)):
        s.add_request(r)
    step(s)
    assert step(s) == ([("A", 1, 8), ("B", 1, 8)], ["C"])
    assert s.num_swap_preemptions == 1 and s.kv_cache.num_swap_outs == 1


@pytest.mark.parametrize("costs, host_slots", [
    (PreemptionCosts("auto", 1e6, 4000.0), 8),     # 4 ms of copies vs 2 ms of prefill
    (PreemptionCosts("auto", 1e6, 2000.0), 8),     # 4 ms each: a tie recomputes
    (PreemptionCosts("recompute", 1e9, 1.0), 8),   # cheap copies, but recompute forced
    (PreemptionCosts("swap", 1e6, 1000.0), 1),     # 2 blocks do not fit 1 host slot
])
def test_recompute_when_swapping_is_not_chosen(costs, host_slots):
    s, (a, b, c) = _swap_scenario(costs, host_slots)
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["C"] and not out.kv_copies.copies
    assert (s.num_swap_preemptions, s.kv_cache.num_swap_outs) == (0, 0)
    assert s.kv_cache.num_free_blocks == 0


def test_swap_in_when_nothing_else_runs_loads_before_the_forward():
    """Swap forced; C resumes in a step where nobody else runs: its loads go
    in kv_copies (this forward waits) and it computes its one new token."""
    s, (a, b, c) = _swap_scenario(PreemptionCosts("swap"))
    assert step(s) == ([("A", 1, 8), ("B", 1, 8)], ["C"])
    assert s.abort_request("A") is a and s.abort_request("B") is b
    out = s.schedule()
    assert [(i.request.request_id, i.num_new_tokens, i.start_pos) for i in out.scheduled] == [("C", 1, 8)]
    assert [x.to_host for x in out.kv_copies.copies] == [False, False] and not out.kv_prefetch
    assert s.num_load_ahead == 0


@pytest.mark.parametrize("policy, num_blocks, host_blocks", [("fcfs", 5, 2), ("prefix", 6, 1)])
def test_load_ahead_needs_room_for_the_hit_and_the_next_tokens(policy, num_blocks, host_blocks):
    """Prefix caching with a host tier, LRU. X (8 tokens) finishes at step 1
    and is written back; Z's two blocks evict X's tail (fcfs, 4 usable: and
    its head) from the GPU at step 2. At step 3, Y (X's 8 tokens + 1) has a
    hit on the host while R runs: loaded ahead it needs its hit's blocks plus
    1 new block, 3, but (fcfs) only 2 are free, or ("prefix") 3 are, of which
    one is kept for R: it waits, not admitted with its hit alone. When R
    finishes, Y is admitted alone: its loads go before this forward and it
    computes 1 token from position 8."""
    s = scheduler(num_blocks, caching=True, host=HostTier(8, block_bytes=100), policy=policy)
    x, r, z = request("X", 8, 1), request("R", 4, 5), request("Z", 8, 1)
    y = Request("Y", x.prompt_token_ids + [5], SamplingParams(max_tokens=5, ignore_eos=True))
    s.add_request(x)
    s.add_request(r)
    assert step(s) == ([("X", 8, 0), ("R", 4, 0)], [])
    s.add_request(z)
    assert step(s) == ([("R", 1, 4), ("Z", 8, 0)], [])
    assert s.kv_cache.num_free_blocks == num_blocks - 3
    s.add_request(y)
    run(s, [([("R", 1, 5)], []), ([("R", 1, 6)], []), ([("R", 1, 7)], [])])  # R finishes
    assert s.num_load_ahead == 0 and list(s.waiting) == [y]
    out = s.schedule()
    assert [(i.request.request_id, i.num_new_tokens, i.start_pos) for i in out.scheduled] == [("Y", 1, 8)]
    assert len([c for c in out.kv_copies.copies if not c.to_host]) == host_blocks and not out.kv_prefetch
    assert s.kv_cache.host_hit_tokens == 4 * host_blocks and s.kv_cache.prefix_cache_hits == 8
    assert s.kv_cache.prefix_cache_queries == 8 + 4 + 8 + 9


def test_swap_out_cost_leaves_out_the_cached_prefix():
    """10 computed tokens in 4-token blocks: 3 blocks, 2 of them full of known
    tokens and cached. Without caching all 3 are copied and 10 tokens
    recomputed; with it the prefix (8 tokens) stays: 1 block, 2 tokens."""
    for caching, cost in [(False, (3000, 10)), (True, (1000, 2))]:
        kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), 16, 4,
                            enable_prefix_caching=caching, host_tier=HostTier(8, block_bytes=1000))
        r = request("A", 10)
        assert kv.allocate_slots(r, 10)
        r.num_computed_tokens = 10
        assert kv.swap_out_cost(r) == cost and kv.can_swap_out(r)
    no_host = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), 16, 4)
    r = request("A", 10)
    assert no_host.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    assert no_host.swap_out_cost(r) == (0, 10) and not no_host.can_swap_out(r)



def test_a_swap_out_leaves_decode_filled_blocks_to_the_prefix_cache():
    """A 6-token prompt, then decode steps through block 1 (known) into block 2:
    the decode paths leave block 1 unoffered, yet the swap's cost and its copy
    count it as the cached prefix (it is offered at the swap-out), so only
    block 2 goes to the host and block 1 is a hit afterwards."""
    kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), 16, 4,
                        enable_prefix_caching=True, host_tier=HostTier(8, block_bytes=1000))
    r = request("A", 6)
    assert kv.allocate_slots(r, 6)
    r.num_computed_tokens = 6
    for token in (7, 8, 9):   # pipelined: position p is scheduled before token p is known
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        r.output_token_ids.append(token)
    assert kv.swap_out_cost(r) == (1000, 1) and kv.can_swap_out(r)
    kv.swap_out(r)
    assert kv.num_swap_outs == 1 and kv.host_tier.num_free_for_swap() == 7
    assert kv.get_computed_blocks(Request("B", r.all_token_ids[:8] + [1], r.sampling_params))[1] == 8

# -- shared-prefix admission ("prefix" policy) -----------------------------------------------

FILE_X, FILE_Y = list(range(10, 22)), list(range(50, 62))  # three 4-token blocks each


def on_file(name: str, file: list[int], tail: list[int]) -> Request:
    return Request(name, file + tail, SamplingParams(max_tokens=8, ignore_eos=True))


def test_each_request_sharing_a_prefilled_prefix_overtakes_the_head():
    """A holds file X, prefilled. Y (another file) heads the queue; x2 and x3
    share X's first block: both go first in the same step, each hitting X's
    12 tokens, and Y is admitted after them, overtaken twice."""
    s = scheduler(64, caching=True, policy="prefix", max_num_seqs=4)
    s.add_request(on_file("a", FILE_X, [1, 2, 3]))
    assert step(s) == ([("a", 15, 0)], [])
    y = on_file("y", FILE_Y, [4, 5])
    for r in (y, on_file("x2", FILE_X, [6, 7]), on_file("x3", FILE_X, [8, 9])):
        s.add_request(r)
    assert step(s) == ([("a", 1, 15), ("x2", 2, 12), ("x3", 2, 12), ("y", 14, 0)], [])
    assert y.num_overtaken == 2 and s.num_prefix_overtakes == 2


def test_an_overtaker_that_does_not_fit_keeps_its_place_at_the_front():
    """6 usable blocks, A holds 4 (file X + 3 tokens). x2 shares X and goes
    ahead of Y, but its 6 new tokens need 2 new blocks plus the one kept free
    per running request, 3 > 2: it waits, now at the head, ahead of Y."""
    s = scheduler(7, caching=True, policy="prefix", max_num_seqs=4)
    s.add_request(on_file("a", FILE_X, [1, 2, 3]))
    assert step(s) == ([("a", 15, 0)], [])
    y, x2 = on_file("y", FILE_Y, [4, 5]), on_file("x2", FILE_X, [6, 7, 8, 9, 10, 11])
    s.add_request(y)
    s.add_request(x2)
    assert step(s) == ([("a", 1, 15)], [])
    assert list(s.waiting) == [x2, y] and y.num_overtaken == 1


def test_a_request_asking_for_prompt_logprobs_does_not_overtake():
    """x3 shares file X but asks for prompt logprobs: a hit would skip rows it
    needs, so it neither goes first nor takes the hit (14 tokens computed)."""
    s = scheduler(64, caching=True, policy="prefix", max_num_seqs=4)
    s.add_request(on_file("a", FILE_X, [1, 2, 3]))
    step(s)
    y = on_file("y", FILE_Y, [4, 5])
    x3 = Request("x3", FILE_X + [8, 9], SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=1))
    for r in (y, on_file("x2", FILE_X, [6, 7]), x3):
        s.add_request(r)
    assert step(s) == ([("a", 1, 15), ("x2", 2, 12), ("y", 14, 0), ("x3", 14, 0)], [])
    assert y.num_overtaken == 1


# -- prompt logprobs and prefix hits ----------------------------------------------------------

def _cached_prompt(s: Scheduler, tokens: list[int]) -> None:
    """Run a one-token request over `tokens`: its 3 full blocks stay cached."""
    s.add_request(Request("cache", list(tokens), SamplingParams(max_tokens=1, ignore_eos=True)))
    assert step(s) == ([("cache", len(tokens), 0)], [])


def _asking(name: str, prompt: list[int], rows: int, outputs: int = 0) -> Request:
    r = Request(name, list(prompt), SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=1))
    r.output_token_ids.extend([5] * outputs)
    r.prompt_logprobs.extend([None] * rows)  # rows it already has (a resumed request)
    return r


@pytest.mark.parametrize("rows, expected", [(0, ("P", 13, 0)), (11, ("P", 13, 0)), (12, ("P", 1, 12))])
def test_prompt_logprobs_take_a_hit_only_over_rows_they_have(rows, expected):
    """12 tokens cached; P's prompt is those 12 + 1. A 12-token hit skips
    the logprob rows of prompt tokens 1..12: taken only with all 12 rows."""
    s = scheduler(64, caching=True)
    tokens = list(range(200, 212))
    _cached_prompt(s, tokens)
    s.add_request(_asking("P", tokens + [99], rows))
    assert step(s) == ([expected], [])
    hit = expected[2]
    assert s.kv_cache.prefix_cache_queries == 12 + (13 if hit else 0)  # a skipped hit is no query
    assert s.kv_cache.prefix_cache_hits == hit


@pytest.mark.parametrize("rows, expected", [(6, ("P", 13, 0)), (7, ("P", 1, 12))])
def test_a_hit_past_the_prompt_needs_every_prompt_row_only(rows, expected):
    """P (8 prompt tokens, 5 outputs: resumed) matches 12 cached tokens; the
    hit covers its whole prompt, whose 7 rows (tokens 1..7) are all it needs."""
    s = scheduler(64, caching=True)
    prompt = list(range(300, 308))
    _cached_prompt(s, prompt + [5] * 5)
    s.add_request(_asking("P", prompt, rows, outputs=5))
    assert step(s) == ([expected], [])


def test_a_swapped_request_asking_for_prompt_logprobs_resumes_from_its_swap():
    """Its own swapped KV skips no row it lacks: resumed from position 8."""
    s = scheduler(7, host=HostTier(8, block_bytes=1000), costs=PreemptionCosts("swap"))
    a, b = request("A", 8, 5), request("B", 8, 5)
    c = _asking("C", list(range(3000, 3008)), rows=0)
    for r in (a, b, c):
        s.add_request(r)
    assert step(s) == ([("A", 8, 0), ("B", 8, 0), ("C", 8, 0)], [])
    assert step(s) == ([("A", 1, 8), ("B", 1, 8)], ["C"])
    s.abort_request("A")
    s.abort_request("B")
    assert step(s) == ([("C", 1, 8)], [])



def test_requests_compare_by_identity():
    """Two requests with equal fields are two requests: the scheduler finds and
    removes a request in its queues by identity (`in`, `list.remove`), which a
    field-by-field __eq__ made cost ~0.6 us per request passed over, and could
    match the wrong one."""
    a, b = request("A", 5), request("A", 5)
    assert a == a and a != b and len({a, b}) == 2
    queue = [a, b]
    queue.remove(b)
    assert queue[0] is a
