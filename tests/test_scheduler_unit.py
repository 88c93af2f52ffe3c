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
              costs: PreemptionCosts | None = None) -> Scheduler:
    kv = KVCacheManager(make_kv_cache_groups([FullAttentionSpec()]), num_blocks, block_size,
                        enable_prefix_caching=caching, eviction_policy="lru", host_tier=host)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_model_len=512, kv_rotation_interval=rotation)
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
    assert a.first_scheduled_time == first and [e for _, e, _ in a.events] == ["scheduled", "prefill"]


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
    assert list(s.waiting) == [b] and s.num_rotations == 2
    assert a.num_preemptions == 1 and b.status == RequestStatus.PREEMPTED


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
    assert not out.kv_copies.copies
    assert [x.to_host for x in out.kv_prefetch.copies] == [False, False]
    assert s.kv_cache.num_swap_ins == 1
    s.update_after_step(out)
    b.output_token_ids.append(SAMPLED)
    assert step(s)[0] == [("B", 1, 11), ("C", 1, 8)]
    assert b.is_finished and s.kv_cache.num_free_blocks == 6 - 3  # C holds 3


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
