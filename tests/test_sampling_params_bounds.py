"""SamplingParams' bounds, field by field: the values at each edge are taken, the
first ones past it (and values of the wrong type) are refused with a ValueError
that names the field and the value, as the server's 400 body repeats it. Also
the flags the sampler plans by (greedy, penalties, logits processing)."""
from __future__ import annotations

import math

import pytest

from kvserve.sampling_params import INT64_MAX, INT64_MIN, MAX_TOP_K, SamplingParams

# field -> (values taken, values refused); each case alone on top of the defaults
BOUNDS = {
    "max_tokens": ([1, 2 ** 40], [0, -1, 1.5, True, None]),
    "temperature": ([0.0, 1e-6, 1e4, 1], [-1e-9, 1e4 + 1e-3, math.nan, "1", None, True]),
    "top_p": ([1e-9, 1.0], [0.0, -0.5, 1.0 + 1e-9, math.nan, "1"]),
    "top_k": ([-1, 0, 1, MAX_TOP_K], [-2, MAX_TOP_K + 1, 1.0, True]),
    "min_p": ([0.0, 1.0], [-1e-9, 1.0 + 1e-9, math.nan, None]),
    "presence_penalty": ([-2.0, 2.0, 0], [-2.0 - 1e-9, 2.0 + 1e-9, math.nan, "0"]),
    "frequency_penalty": ([-2.0, 2.0], [-2.0 - 1e-9, 2.0 + 1e-9, math.nan, False]),
    "repetition_penalty": ([1e-9, 10.0], [0.0, -1.0, 10.0 + 1e-9, math.nan, None]),
    "seed": ([None, 0, INT64_MIN, INT64_MAX], [INT64_MIN - 1, INT64_MAX + 1, 1.0, True, "7"]),
    "logprobs": ([None, 0, 20], [-1, 21, 1.5, True]),
    "prompt_logprobs": ([None, 0, 20], [-1, 21, 2.0, False]),
    "n": ([1, 4], [0, -1, 1.5, True]),
    "stop_token_ids": ([None, [], [0, 7, INT64_MAX]], [[-1], [1.0], ["7"], [True], [INT64_MAX + 1]]),
    "stop": ([None, "x", ["a", "bc"], ()], ["", ["a", ""], [1], [None]]),
}


@pytest.mark.parametrize("name", BOUNDS)
def test_each_field_takes_its_edges_and_refuses_what_lies_past_them(name):
    taken, refused = BOUNDS[name]
    for value in taken:
        assert getattr(SamplingParams(**{name: value}), name) == value
    for value in refused:
        with pytest.raises(ValueError) as error:
            SamplingParams(**{name: value})
        message = str(error.value)
        assert name in message and (repr(value) in message or str(value) in message), message


def test_min_tokens_lies_between_zero_and_max_tokens():
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    assert SamplingParams(max_tokens=5, min_tokens=0).min_tokens == 0
    for value in (6, -1, 1.0, True):
        with pytest.raises(ValueError, match=rf"min_tokens must be between 0 and max_tokens \(5\), got {value!r}"):
            SamplingParams(max_tokens=5, min_tokens=value)


def test_logit_bias_keys_are_token_ids_and_values_lie_in_plus_minus_100():
    params = SamplingParams(logit_bias={0: -100.0, INT64_MAX: 100.0, 7: 0.5})
    assert params.logit_bias[7] == 0.5 and params.needs_logits_processing
    for bias in ({-1: 1.0}, {True: 1.0}, {"5": 1.0}, {1.5: 1.0}):
        with pytest.raises(ValueError, match=rf"logit_bias key {next(iter(bias))!r} is not a token id"):
            SamplingParams(logit_bias=bias)
    for value in (100.0 + 1e-9, -100.0 - 1e-9, math.nan, "1", None):
        with pytest.raises(ValueError, match=rf"logit_bias values must be in \[-100, 100\], got {value!r} for token 3"):
            SamplingParams(logit_bias={3: value})


def test_stop_strings_are_a_tuple_whatever_stop_was():
    assert SamplingParams().stop_strings == ()
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ("a", "bc")


def test_the_flags_the_sampler_plans_by():
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    plain = SamplingParams()
    assert not plain.has_penalties and not plain.needs_logits_processing
    for penalty in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1},
                    {"repetition_penalty": 0.9}):
        params = SamplingParams(**penalty)
        assert params.has_penalties and params.needs_logits_processing, penalty
    for other in ({"min_tokens": 1}, {"logit_bias": {1: 0.0}}, {"structured": object()}):
        params = SamplingParams(**other)
        assert not params.has_penalties and params.needs_logits_processing, other
    assert not SamplingParams(logit_bias={}).needs_logits_processing


def test_with_max_tokens_keeps_every_other_field_and_checks_the_new_one():
    params = SamplingParams(temperature=0.5, top_k=3, seed=9, stop=["z"], min_tokens=2)
    shorter = params.with_max_tokens(4)
    assert shorter.max_tokens == 4 and shorter.stop_strings == ("z",)
    assert (shorter.temperature, shorter.top_k, shorter.seed, shorter.min_tokens) == (0.5, 3, 9, 2)
    with pytest.raises(ValueError, match="min_tokens must be between 0 and max_tokens"):
        params.with_max_tokens(1)


def test_choices_are_n_requests_of_one_seeded_apart():
    from dataclasses import replace

    from kvserve.sampling_params import INT64_MAX, INT64_MIN, child_seed
    one = SamplingParams(temperature=0.5, seed=3)
    assert one.choices() == [one] and one.choices()[0] is one
    params = SamplingParams(n=3, temperature=0.5, seed=INT64_MAX, max_tokens=9)
    assert params.choices() == [replace(params, n=1, seed=s) for s in (INT64_MAX, INT64_MIN, INT64_MIN + 1)]
    assert [c.seed for c in SamplingParams(n=2).choices()] == [None, None]
    assert [child_seed(-1, i) for i in range(3)] == [-1, 0, 1] and child_seed(None, 2) is None


@pytest.mark.parametrize("seed, n", [(7, 3), (2 ** 63 - 1, 3), (-(2 ** 63), 2), (2 ** 63 - 2, 64)])
def test_each_choice_gets_a_distinct_int64_seed(seed, n):
    """Choice i samples with seed + i, wrapped into int64 (two's complement) at the schema's edge:
    every child seed is one SamplingParams takes, and the n of them are distinct. (The server's
    choices and the offline API's are both `choices()`.)"""
    seeds = [c.seed for c in SamplingParams(n=n, seed=seed, temperature=1.0).choices()]
    assert seeds == [(seed + i + 2 ** 63) % 2 ** 64 - 2 ** 63 for i in range(n)]
    assert seeds[0] == seed and len(set(seeds)) == n
    for child in seeds:
        SamplingParams(seed=child, max_tokens=1)   # raises past int64
    assert [c.seed for c in SamplingParams(n=2, seed=None).choices()] == [None, None]
