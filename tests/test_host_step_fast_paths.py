"""The host step's inlined hot loops against the definitions they inline. (The
step's inputs, token by token: `test_batch_reference.py`.)"""
import random

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from tests import random_traffic


def test_the_per_token_fast_test_passes_every_token_that_ends_a_request():
    """`LLMEngine._process` sends a token to the full check only when
    `checks_each_token`, the token is in `stop_ids` or the output reached
    `max_output` (`Request.set_token_checks`). Over random parameters and
    tokens, every token the full check (`_finish_status`) finishes on passes
    that test, and no request that skips the full check has logprobs or
    stop strings to record."""
    from types import SimpleNamespace

    from kvserve.engine.llm_engine import LLMEngine
    rng = random.Random(1)
    engine = SimpleNamespace(scheduler_config=SimpleNamespace(max_model_len=48), _hit_stop_string=lambda r: False)
    finished = 0
    for _ in range(3000):
        params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.sample(range(3, 12), rng.randint(0, 2)) or None,
                                logprobs=rng.choice([None, None, 1]), stop=rng.choice([None, None, ["x"]]))
        request = Request("r", [5] * rng.randint(1, 40), params, eos_token_ids=frozenset({rng.randint(1, 4)}))
        request.output_token_ids = [7] * rng.randint(0, 30)
        request.set_token_checks(48)
        token = rng.randint(1, 12)
        request.output_token_ids.append(token)
        sampled = SimpleNamespace(sampled_logprobs=[0.0], logprobs=[{token: 0.0}])
        status = LLMEngine._finish_status(engine, request, sampled, 0)
        fast_passes = (request.checks_each_token or token in request.stop_ids
                       or len(request.output_token_ids) >= request.max_output)
        assert status is None or fast_passes, (params, token, len(request.output_token_ids))
        assert request.checks_each_token or (params.logprobs is None and not params.stop_strings)
        finished += status is not None
    assert 300 < finished < 2700   # both outcomes were drawn often


def _shadowed_running_rows(scheduler, counts: dict):
    """`Scheduler._running_rows` that also reads every row request by request
    (the streak set aside) and checks both give the same step: rows, budget
    left, decode marks, the tokens each row could still be given, and the
    running requests left without a row."""
    import numpy as np

    from kvserve.scheduler import Scheduler
    original = Scheduler._running_rows

    def running_rows(budget):
        streak = scheduler._streak
        step = streak.next_step(scheduler.running, budget, scheduler._gone) if streak is not None else None
        result = original(scheduler, budget)
        if step is not None:
            held, idle = scheduler._held_streak, scheduler._num_idle
            assert held is not None and held.rows is result[0]
            scheduler._streak = None
            rows, left, marks = original(scheduler, budget)
            scheduler._streak = streak
            assert [tuple(r) for r in result[0]] == [tuple(r) for r in rows]
            assert (result[1], result[2], idle) == (left, marks, scheduler._num_idle)
            assert np.array_equal(held.lefts, scheduler._lefts) and held.starts.tolist() == [r[2] for r in rows]
            assert held.min_left == min(scheduler._lefts)
            if held.previous_rows is not None:   # the rows that stayed, as rows of the streak's step
                ids, kept = held.previous_rows
                assert ids is streak.request_ids and [ids[i] for i in kept] == held.request_ids
                counts["thinned"] += 1
            scheduler._held_streak, scheduler._num_idle = held, idle
        counts["fast" if step is not None else "read"] += 1
        return result
    return running_rows


def test_rows_from_the_decode_streak_equal_rows_read_request_by_request():
    """An engine on a random mix (arrivals, output limits, stop tokens, aborts,
    preemption for lack of blocks, launches that fail) with the scheduler's steady-decode rows
    (`DecodeStreak`) checked at every step against the request-by-request
    reading; both paths are taken many times, and every request ends."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.runner.sampler import RequestFailed
    llm = LLM("dummy:tiny-llama", load_format="dummy", device="cpu", dtype="float32", block_size=4,
              max_model_len=96, num_kv_blocks=32, max_num_seqs=8, max_num_batched_tokens=64)
    engine, rng, counts = llm.engine, random.Random(3), {"fast": 0, "read": 0, "failed": 0, "thinned": 0}
    engine.scheduler._running_rows = _shadowed_running_rows(engine.scheduler, counts)
    run = engine.runner.run

    def flaky_run(*args, **kwargs):   # a launch that fails naming no request: nobody leaves, nothing advances
        if rng.random() < 0.03:
            counts["failed"] += 1
            raise RequestFailed([], RuntimeError("injected"))
        return run(*args, **kwargs)
    engine.runner.run = flaky_run
    requests = random_traffic.drive(engine, rng, steps=400, max_requests=60, arrive=0.25, stop_tokens=0.3)
    assert counts["fast"] > 50 and counts["read"] > 50 and counts["failed"] > 3 and counts["thinned"] > 10, counts
    assert engine.scheduler.num_preemptions > 0, engine.scheduler.num_preemptions
    assert all(r.is_finished for r in requests)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_usable_blocks   # nothing leaked


def test_a_decode_streak_gives_rows_only_while_it_holds():
    """`DecodeStreak.next_step`: the next rows (starts + 1) for the same
    requests in the same order once advanced; None when the launch did not
    advance it, a request was replaced (same count), no row can take another
    token, the budget is short or a request's token is on the host already."""
    import numpy as np

    from kvserve.scheduler import DecodeStreak
    a, b, c = (Request(name, [1, 2], SamplingParams(max_tokens=9), num_pending_tokens=1) for name in "abc")

    def streak(**changes):
        fields = dict(requests=[a, b], starts=np.array([5, 8]), lefts=np.array([3, 4]), min_left=3, advanced=True)
        fields.update(changes)
        return DecodeStreak(**{**fields, "min_left": min(fields["lefts"])})
    step = streak().next_step([a, b], 2)
    assert [tuple(r) for r in step.rows] == [(a, 1, 6), (b, 1, 9)]
    assert step.lefts.tolist() == [2, 3] and step.min_left == 2 and step.previous_rows is None and step.num_idle == 0
    assert streak(advanced=False).next_step([a, b], 2) is None
    assert streak().next_step([a, c], 2) is None
    assert streak().next_step([b, a], 2) is None
    assert streak(lefts=np.array([1, 1])).next_step([a, b], 2) is None
    assert streak().next_step([a, b], 1) is None
    b.num_pending_tokens = 0   # its step was resolved before the next launch: its token is on the host
    assert streak().next_step([a, b], 2) is None


def test_a_decode_streak_goes_on_without_the_rows_that_left():
    """Rows whose requests finished since (`gone`) or whose last token is in
    flight (one token left) drop out; the rest go on, each with its row in the
    streak's step (`previous_rows`, against the streak's own id list). A
    request gone that was not a row changes nothing; running requests that are
    not the rows less those gone (one more gone than said, an order changed,
    an admission) end the streak."""
    import numpy as np

    from kvserve.scheduler import DecodeStreak
    a, b, c, d = (Request(name, [1, 2], SamplingParams(max_tokens=9), num_pending_tokens=1) for name in "abcd")
    other = Request("x", [1], SamplingParams(max_tokens=9))

    def streak(lefts=(3, 4, 5, 6)):
        return DecodeStreak([a, b, c, d], np.array([5, 8, 9, 4]), np.array(lefts), min(lefts), advanced=True)
    s = streak()
    step = s.next_step([a, c, d], 4, [b, other])
    assert [tuple(r) for r in step.rows] == [(a, 1, 6), (c, 1, 10), (d, 1, 5)]
    assert step.request_ids == ["a", "c", "d"] and step.lefts.tolist() == [2, 4, 5] and step.min_left == 2
    assert step.previous_rows[0] is s.request_ids and step.previous_rows[1].tolist() == [0, 2, 3]
    assert step.num_idle == 0
    step = s.next_step([b, d], 4, [c, a])   # two leave at once, apart: each row's own index goes
    assert [r.request for r in step.rows] == [b, d] and step.previous_rows[1].tolist() == [1, 3]
    step = streak(lefts=(3, 1, 5, 6)).next_step([a, b, c, d], 4)   # b's last token is in flight: it idles
    assert [r.request for r in step.rows] == [a, c, d] and step.num_idle == 1
    assert step.previous_rows[1].tolist() == [0, 2, 3]
    step = streak(lefts=(3, 1, 5, 6)).next_step([a, b, d], 4, [c])
    assert [r.request for r in step.rows] == [a, d] and step.num_idle == 1
    assert streak().next_step([a, d], 4, [b]) is None            # c left unsaid
    assert streak().next_step([a, d, c], 4, [b]) is None         # order changed
    assert streak().next_step([a, c, d, other], 4, [b]) is None  # an admission
    assert streak().next_step([a, c, d], 4, []) is None
    assert streak().next_step([a, c, d], 2, [b]) is None         # three rows, a budget of two
