"""The one request-state class the scheduler, cache and engine share.

Lengths are derived, never phase flags: a request is "prefilling" exactly while
it has more than one token whose KV is not yet computed. Chunked prefill, prefix hits and preemption by
recompute all reduce to moving `num_computed_tokens`.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.detokenizer import DetokenizerState
from kvserve.outputs import PromptLogprobRow
from kvserve.sampling_params import SamplingParams


# Placeholder for a token sampled on the device but not yet copied to the host.
PENDING_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"   # failed inside the engine; the others went on

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES


# A tuple, not a set: `in` compares identities first, where a set would hash the
# member through Enum.__hash__, Python code (0.12 against 0.07 us here; asked twice
# per running request per step). Public for the engine's per-token loop, which
# tests `status in FINISHED_STATUSES` itself rather than call a property. A status
# not in it, a running request's, fails four full comparisons (Enum has no __eq__:
# ~0.1 us): the per-row loops ask `status is not RUNNING` first (0.02 us).
FINISHED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                     RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
RUNNING = RequestStatus.RUNNING


# eq=False: a request is itself, compared (and hashed) by identity. The
# dataclass's field-by-field __eq__ made `request in running` and
# `running.remove(request)` cost ~0.6 us per request passed over: ~100 us a
# finished request at 256 running on this project's CPU.
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    # vLLM's `cache_salt`: mixed into the first block's hash, so only requests with the same
    # salt share cached prefixes (a tenant's boundary); None shares with every unsalted request.
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled by a launched step whose ids have not reached the host yet:
    # the next step already computes on them (the engine pipelines one step).
    num_pending_tokens: int = 0
    # KV for all_token_ids[:num_computed_tokens] is in the cache.
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Times a later request was admitted before it (scheduling_policy="prefix").
    num_overtaken: int = 0
    # Chained hashes of the full blocks of all_token_ids; owned and extended by
    # the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    # Sampling bookkeeping.
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: row i is prompt token i + 1's, stored as
    # prefill chunks resolve (kvserve/runner/prompt_logprobs.py).
    prompt_logprobs: list[PromptLogprobRow | None] = field(default_factory=list)
    stop_reason: str | int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Text cut at a stop string (engine-owned; set when one is hit).
    output_text: str = ""
    # Incremental detokenization (kvserve/detokenizer.py) and how much of its
    # text the stop-string check has already scanned.
    detokenizer: DetokenizerState = field(default_factory=DetokenizerState)
    stop_checked_chars: int = 0
    # (time, event, tokens) at the points the scheduler passes through:
    # "scheduled"/"resumed" (tokens: the prefix hit), "prefill" (a prompt chunk's
    # tokens), "preempted" (tokens computed and lost). Arrival, first token and
    # finish are the timestamps above; `timeline()` merges them.
    events: list[tuple[float, str, int]] = field(default_factory=list)
    # What ends the request token by token, set by the engine on arrival
    # (`set_token_checks`), so its per-token loop tests one set and one length:
    # sampling any of `stop_ids` or reaching `max_output` output tokens may end
    # it; `checks_each_token` (logprobs or stop strings) sends every token to the
    # full check. The defaults send every token there.
    stop_ids: frozenset[int] = frozenset()
    max_output: int = 0
    checks_each_token: bool = True

    def set_token_checks(self, max_model_len: int) -> None:
        """`stop_ids`, `max_output` and `checks_each_token` from the sampling
        parameters and the model's length limit."""
        params = self.sampling_params
        eos = frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
        self.stop_ids = eos | frozenset(params.stop_token_ids or ())
        self.max_output = min(params.max_tokens, max_model_len - len(self.prompt_token_ids))
        self.checks_each_token = params.logprobs is not None or bool(params.stop_strings)

    # -- timeline (read by RequestOutput.metrics and kvserve.diagnose) --------
    def record_event(self, event: str, tokens: int) -> None:
        self.events.append((time.monotonic(), event, tokens))

    def on_admitted(self, num_hit_tokens: int) -> None:
        self.record_event("resumed" if self.num_preemptions else "scheduled", num_hit_tokens)

    def timeline(self) -> list[dict[str, float | str | int]]:
        """Arrival, the scheduler's events, first token and finish, in time order."""
        marks = [(self.arrival_time, "arrival", self.num_prompt_tokens), *self.events]
        if self.first_token_time is not None:
            marks.append((self.first_token_time, "first_token", 1))
        if self.finished_time is not None:
            marks.append((self.finished_time, "finish", self.num_output_tokens))
        marks.sort(key=lambda m: m[0])
        return [{"t": t, "event": e, "tokens": n} for t, e, n in marks]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) without building the whole list
        (hot path); positions of pending tokens read PENDING_TOKEN."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:  # one slice, no concatenation: a decode step's block is all output
            known = self.output_token_ids[start - n:end - n]
        else:
            known = self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
        missing = end - start - len(known)
        return known + [PENDING_TOKEN] * missing if missing else known

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus sampled ones still on the device (pipelined steps)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (what block hashes may cover)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def can_grow(self) -> bool:
        """False once the tokens already sampled (pending ones included) reach max_tokens."""
        return len(self.output_token_ids) + self.num_pending_tokens < self.sampling_params.max_tokens

    @property
    def max_total_tokens(self) -> int:
        """Upper bound on the tokens this request can ever hold KV for."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES  # not status.is_finished: one property call less (hot)
