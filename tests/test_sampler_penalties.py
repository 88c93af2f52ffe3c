"""Logits processors of the batched sampler against a float64 reference
written from their definitions (vLLM's):
  - repetition_penalty r: a token seen in the prompt or output has its logit
    divided by r when positive, multiplied by r when not;
  - frequency_penalty f, presence_penalty p: logit -= f * count(output) + p * [count > 0];
  - logit_bias: logit += bias;
  - min_tokens: eos and stop_token_ids are impossible before min_tokens outputs.
Several steps run greedily, so the counts must include the tokens the
sampler itself produced (still on the device in a pipelined engine).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvserve.runner.sampler import RequestFailed, Sampler
from kvserve.sampling_params import SamplingParams

VOCAB = 40
EOS = 1


def reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int],
              num_out: int) -> list[float]:
    x = [float(v) for v in logits]
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if num_out < params.min_tokens:
        for token in {EOS, *(params.stop_token_ids or [])}:
            x[token] = float("-inf")
    seen = set(prompt) | set(output)
    for t in range(len(x)):
        count = output.count(t)
        if t in seen and params.repetition_penalty != 1.0:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        x[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return x


CASES = [
    SamplingParams(temperature=0, repetition_penalty=1.7),
    SamplingParams(temperature=0, frequency_penalty=0.9, presence_penalty=0.4),
    SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.5),
    SamplingParams(temperature=0, logit_bias={3: 6.0, 7: -100.0, 11: 2.5}),
    SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], max_tokens=8),
    SamplingParams(temperature=0),
]


def test_processed_logits_and_greedy_tokens_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(len(CASES), VOCAB, generator=gen, dtype=torch.float64) * 3
    base[4, EOS] = base[4, 5] = 50.0     # eos / stop id would win without min_tokens
    base[0, 2] = base[2, 9] = 0.5        # seen tokens with logits in (0, 1]: divided by r, not multiplied
    sampler = Sampler(0, torch.device("cpu"))
    prompts = [[2, 3, 9, 9, 30] for _ in CASES]
    outputs: list[list[int]] = [[] for _ in CASES]
    ids = [f"r{i}" for i in range(len(CASES))]
    for i, rid in enumerate(ids):
        sampler.track(SimpleNamespace(request_id=rid, prompt_token_ids=prompts[i], output_token_ids=[],
                                      eos_token_ids=frozenset({EOS})))
    for step in range(6):
        logits = base.float()
        states = sampler._states_for(CASES, ids)
        got = sampler._process(logits, CASES, states)
        for i, p in enumerate(CASES):
            want = torch.tensor(reference(base[i].tolist(), p, prompts[i], outputs[i], step), dtype=torch.float64)
            assert torch.allclose(got[i].double(), want, atol=1e-4), (step, i)
        tokens = sampler.sample(logits, CASES, ids).resolve().token_ids
        for i, token in enumerate(tokens):
            want = reference(base[i].tolist(), CASES[i], prompts[i], outputs[i], step)
            assert token == max(range(VOCAB), key=lambda t: want[t]), (step, i)
            outputs[i].append(token)
    assert outputs[4][:3] != [EOS] * 3 and EOS not in outputs[4][:3] and 5 not in outputs[4][:3]
    assert outputs[4][3] in (EOS, 5)          # allowed again from the min_tokens-th token on
    assert all(t == 3 for t in outputs[3])    # the +6 bias wins every step
    assert len(set(outputs[1])) > 1           # the frequency penalty moves greedy off its first pick


def test_penalty_slots_are_reused_and_reset():
    sampler = Sampler(0, torch.device("cpu"))
    params = [SamplingParams(temperature=0, frequency_penalty=2.0)]
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 1.0
    first = [sampler.sample(logits, params, ["a"]).resolve().token_ids[0] for _ in range(3)]
    assert first[0] == 4 and first[1] != 4
    sampler.forget("a")
    again = [sampler.sample(logits, params, ["b"]).resolve().token_ids[0] for _ in range(3)]
    assert again == first                     # the freed slot starts from zero counts


def test_a_row_whose_state_fails_is_named():
    sampler = Sampler(0, torch.device("cpu"))
    bad = SamplingParams(temperature=1.0, seed=7)
    original = sampler._new_state
    sampler._new_state = lambda p, rid: (_ for _ in ()).throw(RuntimeError("boom")) if rid == "bad" \
        else original(p, rid)
    with pytest.raises(RequestFailed) as info:
        sampler.sample(torch.zeros(2, VOCAB), [SamplingParams(), bad], ["ok", "bad"])
    assert info.value.request_ids == ["bad"]
    assert str(info.value) == "requests ['bad'] failed: RuntimeError: boom" and str(info.value.cause) == "boom"


PENALIZED = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.2)


def _penalized_rows(sampler, requests, steps, base):
    """`steps` greedy steps of `requests` (ids, prompts, outputs so far), each row's processed
    logits against the reference over its prompt and every output token, earlier ones included."""
    for _ in range(steps):
        ids, params = [r.request_id for r in requests], [PENALIZED] * len(requests)
        got = sampler._process(base.float()[:len(requests)], params, sampler._states_for(params, ids))
        for i, r in enumerate(requests):
            want = reference(base[i].tolist(), PENALIZED, r.prompt_token_ids, r.output_token_ids, 0)
            assert torch.allclose(got[i].double(), torch.tensor(want, dtype=torch.float64), atol=1e-4), r.request_id
        for r, token in zip(requests, sampler.sample(base.float()[:len(requests)], params, ids).resolve().token_ids):
            r.output_token_ids.append(token)


def test_penalties_count_the_outputs_a_request_had_before_its_state():
    """A request whose sampling state is made after it has output tokens (it resumes after a
    preemption) counts them: its penalties equal the reference over its whole output."""
    base = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3
    sampler = Sampler(0, torch.device("cpu"))
    resumed = SimpleNamespace(request_id="r", prompt_token_ids=[2, 3], output_token_ids=[7, 7, 12],
                              eos_token_ids=frozenset({EOS}))
    sampler.track(resumed)
    _penalized_rows(sampler, [resumed], 3, base)


def test_penalty_buffers_keep_their_counts_when_they_grow():
    """Eight penalized rows fill the first buffers; a ninth grows them: every row's counts
    and prompt mask survive the growth."""
    base = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    sampler = Sampler(0, torch.device("cpu"))
    requests = [SimpleNamespace(request_id=f"r{i}", prompt_token_ids=[i + 2, 30], output_token_ids=[],
                                eos_token_ids=frozenset({EOS})) for i in range(9)]
    for r in requests:
        sampler.track(r)
    _penalized_rows(sampler, requests[:8], 3, base)
    assert sampler.penalties.capacity == 8
    _penalized_rows(sampler, requests, 3, base)
    assert sampler.penalties.capacity == 16


@pytest.mark.parametrize("kwargs", [dict(seed=2 ** 64), dict(top_k=2 ** 40), dict(presence_penalty=3.0),
                                    dict(repetition_penalty=0.0), dict(logit_bias={1: 101.0}),
                                    dict(min_tokens=20, max_tokens=10)])
def test_out_of_range_params_are_rejected_at_construction(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_a_grammar_row_that_fails_is_named():
    from kvserve.structured.grammar import GrammarMatcher

    class Broken(GrammarMatcher):
        def __init__(self) -> None:
            self._last = None

        def fill(self, bitmask, row) -> None:
            raise RuntimeError("matcher broke")

    pytest.importorskip("xgrammar")
    sampler = Sampler(0, torch.device("cpu"))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=1)]
    states = sampler._states_for(params, ["ok", "bad"])
    states[1].grammar = Broken()
    with pytest.raises(RequestFailed) as info:
        sampler.sample(torch.zeros(2, VOCAB), params, ["ok", "bad"])
    assert info.value.request_ids == ["bad"]


def test_the_batch_plan_follows_the_rows_order():
    """Steady decode reuses the last batch's plan (greedy flags, temperatures);
    the same requests in another order must get a new one."""
    sampler = Sampler(0, torch.device("cpu"))
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 1e-3                     # argmax 3; sampling is close to uniform
    for order in (["g", "t"], ["g", "t"], ["t", "g"], ["t", "g"], ["g", "t"]):
        params = [greedy if r == "g" else hot for r in order]
        for _ in range(4):
            ids = sampler.sample(logits, params, order).resolve().token_ids
            assert ids[order.index("g")] == 3, order


def test_a_finished_request_id_that_comes_back_gets_a_fresh_plan():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1e-3                     # argmax 3; sampling is close to uniform
    sampler.sample(logits, [SamplingParams(temperature=1.0)], ["a"]).resolve()
    sampler.forget("a")
    greedy = [SamplingParams(temperature=0)]
    assert [sampler.sample(logits, greedy, ["a"]).resolve().token_ids[0] for _ in range(4)] == [3] * 4


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e-30])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_a_repetition_penalty_near_zero_samples_its_limit(penalty, temperature):
    """As r -> 0 the seen token with the largest positive logit takes all the mass. Below
    float32's range (5e-324 rounds to 0, 1e-40 is subnormal) the quotient was inf and a
    sampled row's probabilities NaN: it drew token 0. Each row samples that seen token, with
    every processed logit finite or -inf (min_tokens' ban)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    logits[:, [2, 3, 9, 30]] = torch.tensor([1.5, 4.0, -2.0, 3.5])   # 3: the largest positive seen logit
    logits[:, 0] = 20.0                                             # unseen, the raw argmax
    params = [SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=s, min_tokens=m,
                             max_tokens=8) for s, m in ((0, 0), (1, 0), (2, 2))]
    sampler, ids = Sampler(0, torch.device("cpu")), ["a", "b", "c"]
    for rid in ids:
        sampler.track(SimpleNamespace(request_id=rid, prompt_token_ids=[2, 3, 9, 9, 30], output_token_ids=[],
                                      eos_token_ids=frozenset({EOS})))
    processed = sampler._process(logits, params, sampler._states_for(params, ids))
    assert not processed.isnan().any() and not (processed == float("inf")).any()
    assert (processed.argmax(dim=-1) == 3).all()
    assert sampler.sample(logits, params, ids).resolve().token_ids == [3, 3, 3]
