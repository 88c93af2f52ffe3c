"""Request outputs with vLLM's shape: RequestOutput -> CompletionOutput, and
prompt logprobs (`RequestOutput.prompt_logprobs`: None for the first prompt
token, then one dict token id -> `Logprob` per token).

The engine keeps prompt logprobs as compact `PromptLogprobRow`s (what the
runner copies back and what crosses to the API process); `prompt_logprobs_of`
turns them into vLLM's dicts where a caller wants those.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log-probability, its rank in the vocabulary
    (1: the most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PromptLogprobRow(NamedTuple):
    """One prompt token's logprob given the tokens before it, its rank, and
    the top-N tokens (most likely first) with their logprobs."""
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


# vLLM's RequestOutput.prompt_logprobs: None for the first token (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


def prompt_logprobs_of(prompt_token_ids: Sequence[int], rows: Sequence[PromptLogprobRow | None],
                       decode: Callable[[int], str] | None = None) -> PromptLogprobs:
    """vLLM's dicts: the prompt token first, then the top-N not already in it.
    A missing row (its step was lost to an engine error) stays None."""
    out: PromptLogprobs = [None]
    for token, row in zip(prompt_token_ids[1:], rows):
        out.append(None if row is None else _entry(token, row, decode))
    return out


def _entry(token: int, row: PromptLogprobRow, decode: Callable[[int], str] | None) -> dict[int, Logprob]:
    def text(t: int) -> str | None:
        return decode(t) if decode is not None else None
    entry = {token: Logprob(row.logprob, row.rank, text(token))}
    for rank, (tid, lp) in enumerate(zip(row.top_ids, row.top_logprobs), start=1):
        if tid not in entry:
            entry[tid] = Logprob(lp, rank, text(tid))
    return entry


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    # Request.timeline(): arrival, scheduled/resumed (+ hit tokens), each prefill
    # chunk (+ tokens), preempted, first_token, finish; times are time.monotonic().
    timeline: list[dict] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs set: see the module docstring; None otherwise.
    prompt_logprobs: PromptLogprobs | None = None
