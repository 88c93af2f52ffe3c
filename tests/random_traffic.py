"""Random traffic for engine-level tests: arrivals of short random prompts with random output
limits, and aborts, one engine step at a time, then the engine run dry."""
from __future__ import annotations

import random

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def drive(engine, rng: random.Random, steps: int, max_requests: int, arrive: float,
          stop_tokens: float = 0.0) -> list[Request]:
    """`steps` steps, each admitting a request with probability `arrive` (up to `max_requests`;
    a share `stop_tokens` of them with a random stop token) and aborting a running one with
    probability 0.03; then steps until nothing is left. Returns the requests made."""
    requests = []
    for _ in range(steps):
        if rng.random() < arrive and len(requests) < max_requests:
            max_tokens = rng.randint(1, 40)   # draws in this order, which the callers' seeds were chosen with
            stop = [rng.randrange(3, 256)] if stop_tokens and rng.random() < stop_tokens else None
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop)
            requests.append(engine.make_request([rng.randrange(3, 256) for _ in range(rng.randint(1, 30))], params))
            engine.add_request(requests[-1])
        if rng.random() < 0.03 and engine.scheduler.running:
            engine.abort_request(rng.choice(engine.scheduler.running).request_id)
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return requests
