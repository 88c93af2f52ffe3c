"""`Request`'s derived state against definitions written out: what ends it token by token
(`set_token_checks`), its timeline, the token ids of a span (pending ones included) and
its lengths."""
from __future__ import annotations

import random

import pytest

from kvserve.request import FINISHED_STATUSES, PENDING_TOKEN, Request, RequestStatus
from kvserve.sampling_params import SamplingParams


def _request(prompt: int = 5, output: int = 0, pending: int = 0, eos=frozenset({2}), **params) -> Request:
    request = Request("r", list(range(10, 10 + prompt)), SamplingParams(**params), eos_token_ids=eos)
    request.output_token_ids.extend(range(100, 100 + output))
    request.num_pending_tokens = pending
    return request


@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize("stop_ids", [None, [7, 9]])
def test_stop_ids_are_eos_unless_ignored_and_the_stop_token_ids(ignore_eos, stop_ids):
    request = _request(eos=frozenset({2, 3}), ignore_eos=ignore_eos, stop_token_ids=stop_ids)
    request.set_token_checks(100)
    want = (set() if ignore_eos else {2, 3}) | set(stop_ids or ())
    assert request.stop_ids == want


@pytest.mark.parametrize("max_tokens, max_model_len, want", [(16, 100, 16), (16, 20, 15), (95, 100, 95),
                                                             (96, 100, 95)])
def test_max_output_is_max_tokens_within_the_model_length(max_tokens, max_model_len, want):
    request = _request(prompt=5, max_tokens=max_tokens)
    request.set_token_checks(max_model_len)
    assert request.max_output == want


@pytest.mark.parametrize("params, each", [({}, False), ({"logprobs": 0}, True), ({"logprobs": 2}, True),
                                          ({"stop": ["x"]}, True), ({"stop": []}, False)])
def test_each_token_goes_to_the_full_check_with_logprobs_or_stop_strings(params, each):
    request = _request(**params)
    assert request.checks_each_token   # before set_token_checks: every token is checked
    request.set_token_checks(100)
    assert request.checks_each_token is each


def test_the_timeline_merges_arrival_events_first_token_and_finish_in_time_order():
    request = _request(prompt=7, output=3)
    request.arrival_time = 10.0
    request.on_admitted(4)
    request.events[-1] = (12.0, *request.events[-1][1:])
    request.events.append((11.0, "prefill", 6))
    request.first_token_time, request.finished_time = 13.0, 14.0
    assert request.timeline() == [
        {"t": 10.0, "event": "arrival", "tokens": 7}, {"t": 11.0, "event": "prefill", "tokens": 6},
        {"t": 12.0, "event": "scheduled", "tokens": 4}, {"t": 13.0, "event": "first_token", "tokens": 1},
        {"t": 14.0, "event": "finish", "tokens": 3}]


def test_a_timeline_without_first_token_or_finish_has_neither():
    request = _request(prompt=2)
    request.arrival_time = 1.0
    assert request.timeline() == [{"t": 1.0, "event": "arrival", "tokens": 2}]


def test_admission_after_a_preemption_is_a_resume_with_its_hit():
    request = _request()
    request.on_admitted(0)
    request.num_preemptions = 1
    request.on_admitted(32)
    assert [(e, n) for _, e, n in request.events] == [("scheduled", 0), ("resumed", 32)]
    assert request.events[0][0] <= request.events[1][0]


def test_token_ids_between_is_a_slice_of_every_token_pending_ones_included():
    rng = random.Random(0)
    for _ in range(300):
        request = _request(prompt=rng.randint(1, 12), output=rng.randint(0, 6), pending=rng.randint(0, 2))
        tokens = request.all_token_ids + [PENDING_TOKEN] * request.num_pending_tokens
        start = rng.randint(0, len(tokens))
        end = rng.randint(start, len(tokens))
        assert request.token_ids_between(start, end) == tokens[start:end], (start, end)


def test_lengths_and_growth():
    request = _request(prompt=5, output=3, pending=1, max_tokens=5)
    assert (request.num_prompt_tokens, request.num_output_tokens) == (5, 3)
    assert (request.num_known_tokens, request.num_tokens, request.max_total_tokens) == (8, 9, 10)
    assert request.all_token_ids == list(range(10, 15)) + [100, 101, 102]
    assert request.can_grow   # 3 + 1 of 5
    request.num_pending_tokens = 2
    assert not request.can_grow


def test_finished_is_each_finished_status_and_no_other():
    request = _request()
    for status in RequestStatus:
        request.status = status
        assert request.is_finished is (status in FINISHED_STATUSES) is status.is_finished
    assert {s.value for s in FINISHED_STATUSES} == {"stop", "length", "abort", "error"}


def test_marks_at_one_time_keep_their_order():
    """A request whose first token is its last: first_token, then finish, at one time
    (sorted by time alone, not by name)."""
    request = _request(prompt=1, output=1)
    request.arrival_time = request.first_token_time = request.finished_time = 5.0
    assert [m["event"] for m in request.timeline()] == ["arrival", "first_token", "finish"]
