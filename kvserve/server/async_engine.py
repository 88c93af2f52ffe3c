"""AsyncEngine: the API server's side of the engine core.

The core (kvserve/engine/core_process.py) schedules and runs the model, in its
own process for `kvserve serve` or on a thread when handed an LLMEngine built
here. Everything with text happens on this side, on the event loop:
tokenizing (chat templates included), building and validating SamplingParams,
incremental detokenization, stop strings (a hit aborts the request in the
core) and logprobs. The core validates limits (context length, KV capacity,
token ids) and accepts or rejects each job before its next step, so `submit`
still raises ValueError (HTTP 400) synchronously.

Inputs go out batched: adds and aborts queued during one turn of the event
loop leave as one message. Outputs come back one message per engine step with
every request's new token ids. If the core dies or raises, every open
submission fails with an OpenAI-style error and `is_healthy` turns False.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from kvserve.engine.core_protocol import (
    CoreInputs, CoreJob, CoreOutput, CoreOutputs, CoreRequest, Rejection, pack_sampling_params)
from kvserve.outputs import PromptLogprobRow
from kvserve.sampling_params import SamplingParams
from kvserve.server.output_processor import ChoiceOutput
from kvserve.server.protocol import APIError

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """The opt-in bound on waiting requests is reached; the client should retry later."""


class EngineDeadError(APIError):
    """The engine core stopped: in-flight requests fail, new ones are refused."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message, type="internal_server_error", code="engine_dead")


@dataclass
class Job:
    """What an HTTP request asks for, before tokenization.

    `prompts` holds text, token ids, or chat messages (a list of dicts); each
    prompt fans out into `n` engine requests. `max_tokens=None` means "the rest
    of the context window".
    """
    prompts: list[str | list[int] | list[dict[str, Any]]]
    params: dict[str, Any]
    max_tokens: int | None
    n: int = 1
    cache_salt: str | None = None   # every choice's (`Request.cache_salt`)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


@dataclass
class Delta:
    """New output of one choice since the previous delta."""
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None   # the stop string or stop token id that ended it
    # Prompt logprobs (SamplingParams.prompt_logprobs), on a choice's first delta only.
    prompt_logprobs: list[PromptLogprobRow | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Choice:
    """One engine request on the API side. Its time fields are the ones
    ServerMetrics.observe_finished reads."""
    submission: "Submission"
    index: int
    request_id: str
    num_prompt_tokens: int
    output: ChoiceOutput
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    last_token_time: float = field(default_factory=time.monotonic)
    num_cached_tokens: int = 0


class Submission:
    """The asyncio side of one Job: acceptance future, its choices, and what they
    have for the reader (`deltas`), in order: choices with new tokens, final deltas,
    a failure.

    A choice with new tokens is queued once until the reader takes it; its delta is
    made then, from every token that arrived meanwhile. A reader that keeps up gets a
    delta per token; one that falls behind (a busy event loop) gets fewer, longer
    ones and the detokenizing and the events are paid per delta, not per token."""

    def __init__(self, job: Job, submission_id: str, on_choice_done) -> None:
        self.job = job
        self.id = submission_id
        self.arrival_time = time.monotonic()
        self.loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[list[int]] = self.loop.create_future()
        self.num_open = job.num_choices   # choices whose final delta is not yet queued
        self.choices: list[_Choice] = []
        self.prompt_lens: list[int] = []
        self.prompt_token_ids: list[list[int]] = []
        self.aborted = False
        self._on_choice_done = on_choice_done
        self._items: collections.deque[_Choice | Delta | Exception] = collections.deque()
        self._queued: set[int] = set()    # choices queued with new tokens, by index
        self._wakeup: asyncio.Future | None = None

    def has_tokens(self, choice: "_Choice") -> None:
        """`choice` got tokens: queue it for the reader unless it already is."""
        if choice.index not in self._queued:
            self._queued.add(choice.index)
            self._put(choice)

    def deliver(self, item: Delta | Exception) -> None:
        self._put(item)
        if isinstance(item, Exception):
            done, self.num_open = self.num_open, 0   # a failure ends every choice
        elif item.finished:
            done, self.num_open = 1, self.num_open - 1
        else:
            return
        self._on_choice_done(done)

    async def next_item(self) -> Delta | Exception | None:
        """The next delta or failure; None for a queued choice with nothing new to send
        (its final delta, made since it was queued, carries its tokens)."""
        while not self._items:
            self._wakeup = self.loop.create_future()
            await self._wakeup
        item = self._items.popleft()
        if not isinstance(item, _Choice):
            return item
        self._queued.discard(item.index)
        if item.finished_time is not None:
            return None
        delta = Delta(item.index, *item.output.next_delta(), prompt_logprobs=item.output.take_prompt_logprobs())
        return delta if delta.token_ids or delta.text or delta.prompt_logprobs else None

    def _put(self, item: "_Choice | Delta | Exception") -> None:
        self._items.append(item)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def resolve(self, result: list[int] | Exception) -> None:
        if self.accepted.done():
            return
        if isinstance(result, Exception):
            self.accepted.set_exception(result)
        else:
            self.accepted.set_result(result)


def _make_core(engine, engine_hook):
    """EngineArgs -> a core process; a built LLMEngine -> a core thread."""
    from kvserve.config import EngineArgs
    from kvserve.engine.core_client import ProcessCoreClient, ThreadCoreClient
    if isinstance(engine, EngineArgs):
        return ProcessCoreClient(engine, engine_hook)
    return ThreadCoreClient(engine)


class AsyncEngine:
    def __init__(self, engine, metrics=None, max_waiting_requests: int | None = None,
                 engine_hook=None) -> None:
        self.core = _make_core(engine, engine_hook)
        # What serving.py and app.py read: tokenizer, scheduler_config, encode_prompt.
        self.engine = self.core.info
        self.cache_info = self.core.info.cache_info
        self.metrics = metrics
        max_num_seqs = self.engine.scheduler_config.max_num_seqs
        self.max_in_flight = None if max_waiting_requests is None else max_num_seqs + max_waiting_requests
        self.num_in_flight = 0          # choices submitted and not finished
        self.error: str | None = None
        self._choices: dict[str, _Choice] = {}       # request id -> accepted choice
        self._pending: dict[str, Submission] = {}    # job id -> submission awaiting accept/reject
        self._inputs = CoreInputs()
        self._flush_scheduled = False
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Call on the event loop that will serve requests."""
        self._loop = asyncio.get_running_loop()
        self.core.start(self._on_outputs, self._on_core_exit)

    def shutdown(self) -> None:
        self.core.shutdown()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self.core.is_alive

    # -- submit / deltas / abort --------------------------------------------------------
    async def submit(self, job: Job) -> tuple[Submission, list[int]]:
        """Queue a job; returns once the core accepted it, with each prompt's token
        count. Raises Overloaded, ValueError naming the violated limit, or
        EngineDeadError."""
        if self.error is not None:
            raise EngineDeadError(503, f"the engine is not running: {self.error}")
        if self.max_in_flight is not None and self.num_in_flight + job.num_choices > self.max_in_flight:
            raise Overloaded(f"the server has {self.num_in_flight} requests in flight "
                             f"(limit {self.max_in_flight}); retry later")
        sub = Submission(job, f"s{next(self._ids)}", self._choice_done)
        core_job = self._make_job(sub)   # tokenizes and validates params: may raise ValueError
        self.num_in_flight += job.num_choices
        self._pending[sub.id] = sub
        self._queue(add=core_job)
        try:
            prompt_lens = await asyncio.shield(sub.accepted)
        except asyncio.CancelledError:
            self.abort(sub)
            # Nobody awaits the answer any more; retrieve it so asyncio does not warn.
            sub.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        return sub, prompt_lens

    async def deltas(self, sub: Submission) -> AsyncIterator[Delta]:
        """Deltas of every choice until all finish; leaving early aborts the rest."""
        # Count finishes as they are consumed: `sub.num_open` counts them as they
        # are queued, which may run ahead of this loop.
        num_unread = sub.job.num_choices
        try:
            while num_unread > 0:
                item = await sub.next_item()
                if item is None:
                    continue
                if isinstance(item, Exception):
                    raise item
                num_unread -= item.finished
                yield item
        finally:
            if sub.num_open > 0:
                self.abort(sub)

    def abort(self, sub: Submission) -> None:
        """Finish the submission's open choices here and free them in the core."""
        if sub.aborted:
            return
        sub.aborted = True
        now = time.monotonic()
        for choice in sub.choices:
            if self._choices.pop(choice.request_id, None) is not None:
                self._finish(choice, "abort", now)
        self._queue(aborts=[c.request_id for c in sub.choices])

    def _choice_done(self, count: int) -> None:
        self.num_in_flight -= count

    # -- jobs ------------------------------------------------------------------------------
    def _make_job(self, sub: Submission) -> CoreJob:
        """Tokenize every prompt and build every choice's params before sending
        any: a bad prompt must not leave half a job running."""
        job, requests = sub.job, []
        for p, prompt in enumerate(job.prompts):
            token_ids = self._tokenize(prompt)
            max_tokens = job.max_tokens or max(1, self.engine.scheduler_config.max_model_len - len(token_ids))
            choices = SamplingParams(**job.params, n=job.n, max_tokens=max_tokens).choices()
            for i, params in enumerate(choices):
                request_id = f"{sub.id}-{p}-{i}"
                output = ChoiceOutput(self.engine.tokenizer, params.stop_strings, params.logprobs is not None,
                                      params.min_tokens)
                sub.choices.append(_Choice(sub, len(sub.choices), request_id, len(token_ids), output,
                                           sub.arrival_time))
                packed, grammar_json = _core_params(params)
                requests.append(CoreRequest(request_id, token_ids, packed, sub.arrival_time, grammar_json,
                                            job.cache_salt))
            sub.prompt_lens.append(len(token_ids))
            sub.prompt_token_ids.append(token_ids)
        return CoreJob(sub.id, requests)

    def _tokenize(self, prompt: str | list[int] | list[dict[str, Any]]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return apply_chat_template(tokenizer, prompt)
        if isinstance(prompt, str):
            return self.engine.encode_prompt(prompt)   # BOS where the tokenizer adds one, as vLLM
        return list(prompt)

    def _queue(self, add: CoreJob | None = None, aborts: list[str] = ()) -> None:
        """Queue core inputs; they leave as one message when this loop turn ends."""
        if add is not None:
            self._inputs.adds.append(add)
        self._inputs.aborts.extend(aborts)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        inputs, self._inputs = self._inputs, CoreInputs()
        if self.error is None and (inputs.adds or inputs.aborts):
            self.core.send(inputs)

    # -- core outputs (on the event loop) ----------------------------------------------------
    def _on_outputs(self, message: CoreOutputs) -> None:
        for job_id in message.accepted:
            self._on_accepted(job_id)
        for rejection in message.rejected:
            self._on_rejected(rejection)
        now = time.monotonic()
        for out in message.every_output():
            choice = self._choices.get(out.request_id)
            if choice is not None:
                self._emit_safely(choice, out, now)
        if message.metrics is not None and self.metrics is not None:
            self.metrics.update(message.metrics)
        if message.error is not None:
            self._on_core_exit(f"the engine core failed: {message.error}")

    def _on_accepted(self, job_id: str) -> None:
        sub = self._pending.pop(job_id, None)
        if sub is None:
            return
        for choice in sub.choices:
            self._choices[choice.request_id] = choice
            if self.metrics is not None:
                self.metrics.count_prompt_tokens(choice.num_prompt_tokens)
        sub.resolve(sub.prompt_lens)
        if sub.aborted:   # cancelled while waiting for the core: finish as aborted now
            sub.aborted = False
            self.abort(sub)

    def _on_rejected(self, rejection: Rejection) -> None:
        sub = self._pending.pop(rejection.job_id, None)
        if sub is None:
            return
        self.num_in_flight -= sub.job.num_choices
        if rejection.invalid:
            sub.resolve(ValueError(rejection.message))
        else:
            sub.resolve(RuntimeError(rejection.message))

    def _emit_safely(self, choice: _Choice, out: CoreOutput, now: float) -> None:
        try:
            self._emit(choice, out, now)
        except Exception as e:  # this submission's failure, not the server's
            logger.exception("request %s: could not process its output", choice.request_id)
            self._fail_submission(choice.submission, EngineDeadError(
                500, f"the server failed while processing this request's output: {type(e).__name__}: {e}"))

    def _emit(self, choice: _Choice, out: CoreOutput, now: float) -> None:
        self._observe_token_times(choice, out, now)
        if out.num_cached_tokens:   # set at first admission; the columns' outputs do not carry it
            choice.num_cached_tokens = out.num_cached_tokens
        if choice.output.append(out.new_token_ids, out.new_logprobs, out.prompt_logprobs):
            self._choices.pop(choice.request_id, None)
            self._queue(aborts=[choice.request_id])   # the core does not know stop strings
            self._finish(choice, "stop", now)
        elif out.finish_reason is not None:
            self._choices.pop(choice.request_id, None)
            self._finish(choice, out.finish_reason, now, out.stop_reason)
        else:
            choice.submission.has_tokens(choice)   # its delta is made when the reader takes it

    def _observe_token_times(self, choice: _Choice, out: CoreOutput, now: float) -> None:
        if out.scheduled_time is not None:
            choice.first_scheduled_time = out.scheduled_time
        if choice.first_token_time is None:
            choice.first_token_time = now
        elif self.metrics is not None:
            self.metrics.observe_inter_token(now - choice.last_token_time)
        choice.last_token_time = now

    def _finish(self, choice: _Choice, reason: str, now: float, stop_token: int | None = None) -> None:
        choice.finished_time = now
        output = choice.output
        # An aborted or failed choice sends its tokens but no more text.
        token_ids, text, logprobs = output.final_delta(aborted=reason in ("abort", "error"))
        stop_reason = output.stop_string if output.stop_string is not None else stop_token
        if self.metrics is not None:
            self.metrics.observe_finished(choice, reason)
        choice.submission.deliver(Delta(choice.index, token_ids, text, logprobs, reason,
                                        choice.num_prompt_tokens, choice.num_cached_tokens, stop_reason,
                                        output.take_prompt_logprobs()))

    # -- failures ------------------------------------------------------------------------------
    def _fail_submission(self, sub: Submission, error: Exception) -> None:
        open_ids = [c.request_id for c in sub.choices if self._choices.pop(c.request_id, None)]
        self._queue(aborts=open_ids)
        sub.deliver(error)

    def _on_core_exit(self, reason: str) -> None:
        """The core is gone: every submission fails, nothing waits for it."""
        if self.error is None:
            logger.error("engine core stopped: %s", reason)
            self.error = reason
        for sub in list(self._pending.values()):
            self.num_in_flight -= sub.job.num_choices
            sub.resolve(EngineDeadError(503, f"the engine is not running: {reason}"))
        self._pending.clear()
        failed = {id(c.submission): c.submission for c in self._choices.values()}
        self._choices.clear()
        for sub in failed.values():
            sub.deliver(EngineDeadError(500, f"the engine failed while running this request: {reason}"))


def _core_params(params: SamplingParams) -> tuple[bytes, str | None]:
    """The core's copy of the params, packed: stop strings stay here (the core has no text)."""
    return pack_sampling_params(replace(params, stop=None) if params.stop_strings else params)


def apply_chat_template(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template: use /v1/completions instead")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
