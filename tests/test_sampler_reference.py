"""The sampler against distributions computed by hand on a six-token vocabulary.

Each filter (top-k, top-p, min-p, temperature) has a reference written here in
plain Python floats from its definition, not from the sampler's code:
  - top-k keeps the k most probable tokens;
  - top-p keeps the smallest most-probable-first prefix whose mass reaches p
    (the most probable token always stays);
  - min-p keeps tokens whose probability is at least min_p times the largest;
and sampling draws from the kept tokens renormalised. The sampler must give
exactly that support (no other token ever drawn, every kept token drawn) and
frequencies within a few standard deviations over thousands of seeded draws.
Logprobs are checked against a hand-computed log-softmax of the raw logits.
"""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.runner.sampler import Sampler
from kvserve.sampling_params import SamplingParams

# Raw logits in vocabulary order: not sorted, so a filter that forgets to map
# sorted ranks back to token ids picks the wrong tokens.
LOGITS = [0.2, 2.0, -3.0, 1.5, -0.5, 1.0]
NUM_DRAWS = 6000


def hand_probs(logits: list[float], temperature: float = 1.0) -> list[float]:
    exps = [math.exp(x / temperature) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def hand_support(probs: list[float], top_k: int = -1, top_p: float = 1.0,
                 min_p: float = 0.0) -> set[int]:
    """The kept token ids, from each filter's definition (module doc)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(order if top_k < 1 else order[:top_k])
    mass, prefix = 0.0, set()
    for token in order:
        prefix.add(token)
        mass += probs[token]
        if mass >= top_p:
            break
    keep &= prefix
    keep &= {i for i, p in enumerate(probs) if p >= min_p * max(probs)}
    return keep


def draw(params: SamplingParams, num: int = NUM_DRAWS, seed: int = 0) -> list[int]:
    """`num` independent draws: one batch of `num` identical rows."""
    sampler = Sampler(seed, torch.device("cpu"))
    logits = torch.tensor([LOGITS] * num)
    return sampler.sample(logits, [params] * num, [f"r{i}" for i in range(num)]).resolve().token_ids


CASES = {  # name -> (params, expected support computed by hand for LOGITS)
    "plain": (SamplingParams(), {0, 1, 2, 3, 4, 5}),
    "top_k=1": (SamplingParams(top_k=1), {1}),
    "top_k=3": (SamplingParams(top_k=3), {1, 3, 5}),
    "top_p=0.7": (SamplingParams(top_p=0.7), {1, 3}),
    "top_p=0.75": (SamplingParams(top_p=0.75), {1, 3, 5}),
    "min_p=0.3": (SamplingParams(min_p=0.3), {1, 3, 5}),
    "min_p=0.5": (SamplingParams(min_p=0.5), {1, 3}),
    "t=2,top_p=0.6": (SamplingParams(temperature=2.0, top_p=0.6), {1, 3, 5}),
    "t=0.5,min_p=0.05": (SamplingParams(temperature=0.5, min_p=0.05), {1, 3, 5}),
    "top_k=4,min_p=0.2": (SamplingParams(top_k=4, min_p=0.2), {1, 3, 5}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_support_and_frequencies_match_the_hand_computed_distribution(name):
    params, support = CASES[name]
    probs = hand_probs(LOGITS, params.temperature)
    assert hand_support(probs, params.top_k, params.top_p, params.min_p) == support  # the table
    ids = draw(params)
    assert set(ids) == support, f"{name}: drew {sorted(set(ids))}, expected exactly {sorted(support)}"
    kept_mass = sum(probs[i] for i in support)
    for token in support:
        expected = probs[token] / kept_mass
        sigma = math.sqrt(expected * (1 - expected) / NUM_DRAWS)
        observed = ids.count(token) / NUM_DRAWS
        assert abs(observed - expected) < 5 * sigma + 1e-3, (name, token, observed, expected)


def test_each_row_gets_its_own_filter():
    """Rows with different filters in one batch: every row's support is its own."""
    names = sorted(CASES)
    num_per = 400
    params = [CASES[n][0] for n in names for _ in range(num_per)]
    sampler = Sampler(3, torch.device("cpu"))
    logits = torch.tensor([LOGITS] * len(params))
    ids = sampler.sample(logits, params, [f"r{i}" for i in range(len(params))]).resolve().token_ids
    for k, name in enumerate(names):
        drawn = set(ids[k * num_per:(k + 1) * num_per])
        assert drawn <= CASES[name][1], name
        if len(CASES[name][1]) <= 3:  # small supports are drawn in full at 400 draws
            assert drawn == CASES[name][1], name


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0)]
    rows = [LOGITS, LOGITS, [5.0, 0.0, 0.0, 0.0, 0.0, 6.0]]
    for seed in range(20):
        ids = Sampler(seed, torch.device("cpu")).sample(torch.tensor(rows), params, ["a", "b", "c"])
        out = ids.resolve().token_ids
        assert out[0] == 1 and out[2] == 5


def test_random_rows_stay_random_beside_greedy_ones():
    """A temperature-1 row in a batch with greedy rows is still sampled, not
    taken as the argmax: over 20 seeds, a flat row's draws cover its vocabulary."""
    params = [SamplingParams(temperature=0.0), SamplingParams()]
    flat = [0.0] * 6
    drawn = {Sampler(seed, torch.device("cpu")).sample(torch.tensor([LOGITS, flat]), params, ["a", "b"])
             .resolve().token_ids[1] for seed in range(20)}
    assert len(drawn) >= 3, drawn


def test_seeded_request_ignores_the_rest_of_the_batch():
    seeded = SamplingParams(seed=1234)
    alone = [_draw_seq(Sampler(0, torch.device("cpu")), [seeded], ["s"], 0) for _ in range(2)]
    assert alone[0] == alone[1]
    crowded = _draw_seq(Sampler(99, torch.device("cpu")), [SamplingParams(), seeded, SamplingParams()],
                        ["x", "s", "y"], 1)
    assert crowded == alone[0]
    # Another seed gives another sequence (20 draws from 6 tokens).
    assert _draw_seq(Sampler(0, torch.device("cpu")), [SamplingParams(seed=4321)], ["s"], 0) != alone[0]


def _draw_seq(sampler: Sampler, params, rids, row: int, steps: int = 20) -> list[int]:
    logits = torch.tensor([LOGITS] * len(params))
    return [sampler.sample(logits, params, rids).resolve().token_ids[row] for _ in range(steps)]


def test_forget_restarts_a_seeded_generator():
    sampler = Sampler(0, torch.device("cpu"))
    params, logits = [SamplingParams(seed=7)], torch.tensor([LOGITS])
    first = [sampler.sample(logits, params, ["s"]).resolve().token_ids[0] for _ in range(15)]
    sampler.forget("s")
    again = [sampler.sample(logits, params, ["s"]).resolve().token_ids[0] for _ in range(15)]
    assert again == first


def hand_logprobs(logits: list[float]) -> list[float]:
    top = max(logits)
    log_total = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - log_total for x in logits]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.5])
def test_logprobs_are_log_softmax_of_the_raw_logits(temperature):
    """Logprobs (sampled token and top-n) are of the unscaled distribution, as
    in vLLM's default; each row returns exactly the number it asked for."""
    rows = [LOGITS, [x * 0.3 - 1 for x in LOGITS], LOGITS[::-1], LOGITS]
    wants = [None, 0, 2, 4]
    params = [SamplingParams(temperature=temperature, logprobs=w) for w in wants]
    out = Sampler(5, torch.device("cpu")).sample(torch.tensor(rows), params, list("abcd")).resolve()
    assert len(out.logprobs) == len(out.sampled_logprobs) == len(out.token_ids) == 4
    assert out.logprobs[0] is None
    for row, want, token, entry, sampled in zip(rows, wants, out.token_ids, out.logprobs,
                                                out.sampled_logprobs):
        ref = hand_logprobs(row)
        assert sampled == pytest.approx(ref[token], abs=1e-5)
        if want is None:
            continue
        top = sorted(range(len(row)), key=lambda i: -ref[i])[:want]
        assert set(entry) == set(top) | {token}
        for tid, lp in entry.items():
            assert lp == pytest.approx(ref[tid], abs=1e-5), (tid, lp, ref[tid])


def test_no_logprobs_when_nobody_asks():
    out = Sampler(0, torch.device("cpu")).sample(torch.tensor([LOGITS] * 2),
                                                 [SamplingParams(), SamplingParams(temperature=0)],
                                                 ["a", "b"]).resolve()
    assert out.logprobs == [None, None] and out.sampled_logprobs == [None, None]
    assert out.token_ids[1] == 1


def test_one_top_logprob_plus_the_sampled_token():
    """logprobs=1: the entry holds the most probable token and, when another
    was drawn, the drawn one too (flat logits make that happen often)."""
    flat = [0.0, 0.1, 0.0, -0.1, 0.05, 0.0]
    ref = hand_logprobs(flat)
    params = [SamplingParams(logprobs=1)] * 64
    out = Sampler(2, torch.device("cpu")).sample(torch.tensor([flat] * 64), params,
                                                 [f"r{i}" for i in range(64)]).resolve()
    assert any(t != 1 for t in out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert set(entry) == {1, token}
        assert all(lp == pytest.approx(ref[t], abs=1e-5) for t, lp in entry.items())


@pytest.mark.parametrize("params, support_size", [
    (SamplingParams(top_p=0.5), 2),   # mass before the 3rd of 4 equal tokens is exactly 0.5: dropped
    (SamplingParams(top_p=0.51), 3),
    (SamplingParams(min_p=1.0), 4),   # every probability equals 1.0 x the largest: all kept
])
def test_filter_boundaries_on_four_equal_tokens(params, support_size):
    """Probabilities of exactly 0.25 (float-exact) put each filter on its
    boundary: top-p keeps the smallest prefix whose mass reaches p, min-p
    keeps a token whose probability is at least min_p x the largest."""
    num = 800
    ids = Sampler(1, torch.device("cpu")).sample(torch.zeros(num, 4), [params] * num,
                                                 [f"r{i}" for i in range(num)]).resolve().token_ids
    assert len(set(ids)) == support_size


def test_unseeded_rows_follow_the_sampler_seed_only():
    """Unseeded rows draw from the sampler's own generator: the engine seed
    fixes them whatever else touched torch's global generator."""
    def run(sampler_seed: int, global_seed: int) -> list[int]:
        sampler = Sampler(sampler_seed, torch.device("cpu"))
        torch.manual_seed(global_seed)
        return draw_with(sampler, SamplingParams(), 200)
    assert run(7, 0) == run(7, 12345)
    assert run(7, 0) != run(8, 0)


def draw_with(sampler: Sampler, params: SamplingParams, num: int) -> list[int]:
    logits = torch.tensor([LOGITS] * num)
    return sampler.sample(logits, [params] * num, [f"r{i}" for i in range(num)]).resolve().token_ids
