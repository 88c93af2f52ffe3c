"""The host step's inlined hot loops against the definitions they inline:
random requests (prompt, output and pending tokens) and random batches."""
import random

import torch

from kvserve.request import PENDING_TOKEN, Request
from kvserve.runner.batch import build_host_batch, to_model_inputs
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import ScheduledRequest


def _random_request(rng: random.Random, i: int) -> Request:
    request = Request(str(i), [rng.randint(3, 999) for _ in range(rng.randint(1, 40))],
                      SamplingParams(max_tokens=64))
    request.output_token_ids = [rng.randint(3, 999) for _ in range(rng.randint(0, 10))]
    request.num_pending_tokens = rng.choice([0, 0, 1])
    return request


def _random_batch(rng: random.Random, decode_only: bool) -> list[ScheduledRequest]:
    scheduled = []
    for i in range(rng.randint(1, 24)):
        request = _random_request(rng, i)
        start = rng.randrange(request.num_tokens)
        num_new = 1 if decode_only else rng.randint(1, request.num_tokens - start)
        scheduled.append(ScheduledRequest(request, num_new, start))
    return scheduled


def test_decode_and_mixed_batches_match_a_per_token_walk():
    """Token ids (pending ones included) and the rows that sample, for
    decode-only batches (the inlined path) and mixed ones."""
    rng = random.Random(0)
    for trial in range(200):
        scheduled = _random_batch(rng, decode_only=trial % 2 == 0)
        tables = [torch.zeros(len(scheduled), 8, dtype=torch.int32)]  # 16-token blocks: 128 positions
        host = build_host_batch(scheduled, tables)
        ids = []
        for s in scheduled:
            r = s.request
            tokens = r.prompt_token_ids + r.output_token_ids + [PENDING_TOKEN] * r.num_pending_tokens
            ids += tokens[s.start_pos:s.start_pos + s.num_new_tokens]
        assert host.input_ids.tolist() == ids
        inputs = to_model_inputs(host, scheduled, 16, torch.device("cpu"))
        assert inputs.sampling_rows == [s for s in scheduled if s.completes_sequence]
        assert inputs.logits_indices.tolist() == [
            int(host.query_start_loc[i + 1]) - 1 for i, s in enumerate(scheduled) if s.completes_sequence]


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
