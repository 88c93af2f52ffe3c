"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's
log-probability given the tokens before it, its rank in the vocabulary and
the top-N alternatives, taken from the prefill's hidden states.

Only requests that ask pay. `PromptLogprobs` tracks them (the engine
registers each at intake); a step that schedules none of them costs one
dict check. For those it schedules, the logits of their prompt rows alone are
computed, in passes of `ROWS_PER_PASS` rows so the [rows, vocab] buffers
stay bounded, packed into one float64 tensor and copied to the host behind
an event, as sampled ids are; resolving the step stores the rows in
`Request.prompt_logprobs` (raw logits, no sampling processors: vLLM's
default).

Position p's logits give prompt token p + 1's logprob, so a chunk that
computes positions [start, start + n) yields rows for tokens start + 1 ..
start + n, up to the last prompt token. A request resumes from the rows it
has (after a preemption by recompute, or a step that failed before it was
committed), so each row is computed once; the scheduler lets such a request
take a prefix hit only over positions whose rows it has, since a hit skips
computing them (see scheduler.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvserve.outputs import PromptLogprobRow
from kvserve.request import Request
from kvserve.runner.sampler import _to_host_async
from kvserve.runner.staging import upload
from kvserve.scheduler import ScheduledRequest

# Prompt rows per logits pass: 512 x a 152K vocabulary is ~300 MB of float32.
ROWS_PER_PASS = 512


@dataclass
class _Span:
    """Rows of one request in one step: positions [first, first + count)."""
    request: Request
    first: int
    row: int      # the first position's row in the step's hidden states
    count: int


class PromptLogprobs:
    """The requests whose prompt rows are not all stored yet."""

    def __init__(self) -> None:
        self._waiting: dict[str, Request] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def track(self, request: Request) -> None:
        if request.sampling_params.prompt_logprobs is not None and not _complete(request):
            self._waiting[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def launch(self, model: torch.nn.Module, hidden: torch.Tensor, scheduled: list[ScheduledRequest],
               query_start_loc: torch.Tensor) -> "PendingPromptLogprobs | None":
        """Queue the logprobs of this step's prompt rows of tracked requests."""
        spans = self._spans(scheduled, query_start_loc)
        if not spans:
            return None
        num_top = max(s.request.sampling_params.prompt_logprobs for s in spans)
        host, ready = _to_host_async(_compute(model, hidden, spans, num_top))
        return PendingPromptLogprobs(self, spans, host, ready, num_top)

    def _spans(self, scheduled: list[ScheduledRequest], query_start_loc: torch.Tensor) -> list[_Span]:
        spans = []
        for i, s in enumerate(scheduled):
            request = self._waiting.get(s.request.request_id)
            if request is None:
                continue
            # Rows already stored, or on their way from the step in flight, are not redone.
            first = max(s.start_pos, len(request.prompt_logprobs))
            end = min(s.start_pos + s.num_new_tokens, request.num_prompt_tokens - 1)
            if first < end:
                spans.append(_Span(request, first, int(query_start_loc[i]) + first - s.start_pos, end - first))
        return spans

    def on_stored(self, request: Request) -> None:
        if _complete(request):
            self._waiting.pop(request.request_id, None)


class PendingPromptLogprobs:
    """A step's prompt rows on their way to the host."""

    def __init__(self, tracker: PromptLogprobs, spans: list[_Span], host: torch.Tensor,
                 ready: torch.cuda.Event | None, num_top: int) -> None:
        self._tracker, self._spans = tracker, spans
        self._host, self._ready, self._num_top = host, ready, num_top

    def resolve(self) -> None:
        """Wait for the rows and store them in their requests."""
        if self._ready is not None:
            self._ready.synchronize()
        values = iter(self._host.tolist())
        for span in self._spans:
            n = span.request.sampling_params.prompt_logprobs
            rows = [_row(v, n, self._num_top) for v in itertools.islice(values, span.count)]
            _store(span.request, span.first, rows)
            self._tracker.on_stored(span.request)


def _compute(model: torch.nn.Module, hidden: torch.Tensor, spans: list[_Span], num_top: int) -> torch.Tensor:
    """[rows, 2 + 2 * num_top] float64: logprob and rank of each next prompt
    token, then the top ids and their logprobs (ids are exact in float64)."""
    rows = torch.cat([torch.arange(s.row, s.row + s.count) for s in spans])
    targets = torch.tensor(list(itertools.chain.from_iterable(
        s.request.prompt_token_ids[s.first + 1:s.first + 1 + s.count] for s in spans)))
    rows, targets = upload(rows, hidden.device), upload(targets, hidden.device)
    parts = [_pack(model.compute_logits(hidden[rows[a:a + ROWS_PER_PASS]]), targets[a:a + ROWS_PER_PASS],
                   num_top) for a in range(0, len(rows), ROWS_PER_PASS)]
    return torch.cat(parts)


def _pack(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = logprobs.gather(1, targets.unsqueeze(1))
    rank = (logprobs > target).sum(dim=-1, keepdim=True) + 1   # vLLM's rank: 1 + tokens more likely
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return torch.cat([target.double(), rank.double(), top_ids.double(), top_logprobs.double()], dim=1)


def _row(values: list[float], n: int, num_top: int) -> PromptLogprobRow:
    return PromptLogprobRow(values[0], int(values[1]), [int(t) for t in values[2:2 + n]],
                            values[2 + num_top:2 + num_top + n])


def _store(request: Request, first: int, rows: list[PromptLogprobRow]) -> None:
    stored = request.prompt_logprobs
    if len(stored) < first:  # the rows before were lost with a step the engine failed
        stored.extend([None] * (first - len(stored)))
    stored[first:first + len(rows)] = rows


def _complete(request: Request) -> bool:
    return len(request.prompt_logprobs) >= request.num_prompt_tokens - 1
