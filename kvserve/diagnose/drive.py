"""Run requests through an `LLM`'s engine step by step while recording: the
offline half of the evidence chain (and `kvserve bench sweep`'s runner).

Arrivals: all at once (`requests_per_step=None`), or a steady rate counted in
engine steps, which makes a seeded run reproducible on any machine. A
multi-turn follow-up (`after`) is added only once its predecessor finished.
Inter-token latencies are measured here, when a step hands a request its
next token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.diagnose.record import MetricsRecorder, Record
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class DriveRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    # Index of the request that must finish before this one is sent.
    after: int | None = None


@dataclass
class DriveResult:
    outputs: list[RequestOutput]
    record: Record
    elapsed_s: float
    itl_s: list[float] = field(default_factory=list)


class _Arrivals:
    """Which requests may be added now: due by the schedule, predecessor done."""

    def __init__(self, requests: list[DriveRequest], requests_per_step: float | None) -> None:
        self.requests, self.rate = requests, requests_per_step
        self.next_index, self.parked, self.done = 0, [], set()

    def due(self, step: int) -> list[int]:
        ready = [i for i in self.parked if self.requests[i].after in self.done]
        self.parked = [i for i in self.parked if i not in ready]
        while self.next_index < len(self.requests) and (self.rate is None or self.next_index <= step * self.rate):
            i, self.next_index = self.next_index, self.next_index + 1
            after = self.requests[i].after
            (ready if after is None or after in self.done else self.parked).append(i)
        return ready


def run_recorded(llm, requests: list[DriveRequest], requests_per_step: float | None = None,
                 sample_period_s: float = 0.05, temperature: float = 0.0) -> DriveResult:
    if not requests:
        raise ValueError("run_recorded needs at least one request")
    engine = llm.engine
    recorder = MetricsRecorder(llm, sample_period_s)
    arrivals = _Arrivals(requests, requests_per_step)
    live, index_of, last_token, itl = {}, {}, {}, []
    recorder.sample()
    start, step = time.perf_counter(), 0
    while len(arrivals.done) < len(requests):
        for i in arrivals.due(step):
            r = requests[i]
            params = SamplingParams(max_tokens=r.max_tokens, temperature=temperature, ignore_eos=True)
            request = engine.make_request(list(r.prompt_token_ids), params)
            engine.add_request(request)
            live[i], index_of[request.request_id] = request, i
        if not engine.has_unfinished_requests():
            step += 1  # waiting for the next scheduled arrival
            continue
        now_touched, now = engine.step(), time.monotonic()
        for request in now_touched:
            if request.request_id in last_token:
                itl.append(now - last_token[request.request_id])
            last_token[request.request_id] = now
            if request.is_finished:
                arrivals.done.add(index_of[request.request_id])
        recorder.maybe_sample()
        step += 1
    elapsed = time.perf_counter() - start
    outputs = [engine.make_output(live[i]) for i in range(len(requests))]
    return DriveResult(outputs, recorder.finish(outputs), elapsed, itl)
