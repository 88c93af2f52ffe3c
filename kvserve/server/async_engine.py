"""AsyncEngine: runs one LLMEngine on a background thread and streams deltas
to asyncio consumers.

The engine thread is the only caller of LLMEngine methods (tokenizing and
chat templates included). HTTP handlers talk to it through a thread-safe
command queue (submit, abort); it answers through `loop.call_soon_threadsafe`
into one asyncio queue per submission. When no request is unfinished the
thread sleeps on an event, so an idle server burns no CPU. Every request in
flight shares each `engine.step()`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """The bounded waiting queue is full; the client should retry later."""


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Submission:
    """The asyncio side of one Job: acceptance future and delta queue."""

    def __init__(self, job: Job, submission_id: str, on_choice_done) -> None:
        self.job = job
        self.id = submission_id
        self.arrival_time = time.monotonic()
        self.loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[list[int]] = self.loop.create_future()
        self.deltas: asyncio.Queue[Delta | Exception] = asyncio.Queue()
        self.num_open = job.num_choices   # choices whose final delta is not yet queued
        self._on_choice_done = on_choice_done

    # Called on the event loop thread only.
    def deliver(self, item: Delta | Exception) -> None:
        self.deltas.put_nowait(item)
        if isinstance(item, Exception):
            done, self.num_open = self.num_open, 0   # a failure ends every choice
        elif item.finished:
            done, self.num_open = 1, self.num_open - 1
        else:
            return
        self._on_choice_done(done)

    def resolve(self, result: list[int] | Exception) -> None:
        if self.accepted.done():
            return
        if isinstance(result, Exception):
            self.accepted.set_exception(result)
        else:
            self.accepted.set_result(result)


@dataclass
class _Choice:
    """Engine-thread bookkeeping for one engine request."""
    submission: Submission
    index: int
    request: Request
    num_sent_tokens: int = 0
    sent_text: str = ""
    last_token_time: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, engine, metrics=None, max_waiting_requests: int = 256) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_in_flight = engine.scheduler_config.max_num_seqs + max_waiting_requests
        self.num_in_flight = 0          # choices accepted and not finished (loop thread)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._choices: dict[str, _Choice] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self.error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self._publish_snapshot()
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- the asyncio side ------------------------------------------------------
    async def submit(self, job: Job) -> tuple[Submission, list[int]]:
        """Queue a job; returns once the engine accepted it, with each prompt's
        token count. Raises Overloaded, or ValueError naming the violated limit."""
        if self.num_in_flight + job.num_choices > self.max_in_flight:
            raise Overloaded(f"the server has {self.num_in_flight} requests in flight "
                             f"(limit {self.max_in_flight}); retry later")
        sub = Submission(job, f"s{next(self._ids)}", self._choice_done)
        self.num_in_flight += job.num_choices
        self._send(("submit", sub))
        try:
            prompt_lens = await asyncio.shield(sub.accepted)
        except asyncio.CancelledError:
            self.abort(sub)
            # Nobody awaits the answer any more; retrieve it so asyncio does not warn.
            sub.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        except Exception:
            self.num_in_flight -= job.num_choices
            raise
        return sub, prompt_lens

    async def deltas(self, sub: Submission) -> AsyncIterator[Delta]:
        """Deltas of every choice until all finish; leaving early aborts the rest."""
        # Count finishes as they are consumed: `sub.num_open` counts them as they
        # are queued, which may run ahead of this loop.
        num_unread = sub.job.num_choices
        try:
            while num_unread > 0:
                item = await sub.deltas.get()
                if isinstance(item, Exception):
                    raise item
                num_unread -= item.finished
                yield item
        finally:
            if sub.num_open > 0:
                self.abort(sub)

    def abort(self, sub: Submission) -> None:
        self._send(("abort", sub))

    def _choice_done(self, count: int) -> None:
        self.num_in_flight -= count

    def _send(self, command: tuple[str, Submission]) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._iterate()
            except Exception as e:  # the thread must outlive a bug: fail requests, report unhealthy
                logger.exception("engine thread error")
                self.error = e
                self._fail_all(e)

    def _iterate(self) -> None:
        busy = self._drain_commands()
        if self.engine.has_unfinished_requests():
            self._step()
            return
        if busy:
            self._publish_snapshot()
        self._wake.wait()
        self._wake.clear()

    def _drain_commands(self) -> bool:
        drained = False
        while True:
            try:
                kind, sub = self._commands.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            if kind == "submit":
                self._accept(sub)
            else:
                self._abort(sub)

    def _step(self) -> None:
        touched = self.engine.step()
        now = time.monotonic()
        for request in touched:
            choice = self._choices.get(request.request_id)
            if choice is not None:
                self._emit(choice, now)
        self._publish_snapshot()

    def _accept(self, sub: Submission) -> None:
        try:
            requests, prompt_lens = self._make_requests(sub)
        except Exception as e:  # ValueError: a limit; anything else (a template error): still this job's
            sub.loop.call_soon_threadsafe(sub.resolve, e)
            return
        for index, request in enumerate(requests):
            self.engine.add_request(request)
            self._choices[request.request_id] = _Choice(sub, index, request)
            if self.metrics is not None:
                self.metrics.count_prompt_tokens(request.num_prompt_tokens)
        sub.loop.call_soon_threadsafe(sub.resolve, prompt_lens)

    def _make_requests(self, sub: Submission) -> tuple[list[Request], list[int]]:
        """Validate every choice before adding any: a bad prompt must not leave
        half a job running."""
        job, requests, prompt_lens = sub.job, [], []
        for p, prompt in enumerate(job.prompts):
            token_ids = self._tokenize(prompt)
            max_tokens = job.max_tokens or max(1, self.engine.scheduler_config.max_model_len - len(token_ids))
            for i in range(job.n):
                params = SamplingParams(**_child_params(job.params, i), max_tokens=max_tokens)
                request = self.engine.make_request(token_ids, params, f"{sub.id}-{p}-{i}")
                request.arrival_time = sub.arrival_time
                requests.append(request)
            prompt_lens.append(len(token_ids))
        return requests, prompt_lens

    def _tokenize(self, prompt: str | list[int] | list[dict[str, Any]]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return apply_chat_template(tokenizer, prompt)
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("this model has no tokenizer: send the prompt as a list of token ids")
            if not prompt:
                raise ValueError("prompt must not be empty")
            return list(tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def _abort(self, sub: Submission) -> None:
        for request_id, choice in list(self._choices.items()):
            if choice.submission is sub:
                self.engine.abort_request(request_id)
                self._finish(choice, "abort", time.monotonic())

    def _fail_all(self, error: Exception) -> None:
        for request_id, choice in list(self._choices.items()):
            self._choices.pop(request_id)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort %s", request_id)
            choice.submission.loop.call_soon_threadsafe(choice.submission.deliver, RuntimeError(
                f"the engine failed while running this request: {error}"))

    def _emit(self, choice: _Choice, now: float) -> None:
        request = choice.request
        new_tokens = request.output_token_ids[choice.num_sent_tokens:]
        if self.metrics is not None and choice.num_sent_tokens > 0:
            self.metrics.observe_inter_token(now - choice.last_token_time)
        choice.last_token_time = now
        if request.is_finished:
            self._finish(choice, request.status.value, now)
            return
        text = self._text_so_far(request)
        delta = Delta(choice.index, new_tokens, text[len(choice.sent_text):], _new_logprobs(choice))
        choice.num_sent_tokens, choice.sent_text = request.num_output_tokens, text
        self._deliver(choice, delta)

    def _text_so_far(self, request: Request) -> str:
        """Detokenized output, holding back what may still change: an incomplete
        UTF-8 character, or a tail that could grow into a stop string."""
        text = self.engine.output_text_so_far(request)
        stops = request.sampling_params.stop_strings
        if stops:
            text = text[:max(0, len(text) - max(len(s) for s in stops) + 1)]
        return text

    def _finish(self, choice: _Choice, reason: str, now: float) -> None:
        request = choice.request
        self._choices.pop(request.request_id, None)
        text = self.engine.make_output(request).outputs[0].text if reason != "abort" else choice.sent_text
        if text.startswith(choice.sent_text):
            new_text = text[len(choice.sent_text):]
        else:  # streamed text cannot be taken back; say so rather than drop it silently
            logger.warning("request %s: final text does not extend the streamed text; "
                           "sending no final delta", request.request_id)
            new_text = ""
        delta = Delta(choice.index, request.output_token_ids[choice.num_sent_tokens:], new_text,
                      _new_logprobs(choice), reason, request.num_prompt_tokens,
                      max(request.num_cached_tokens, 0))
        if self.metrics is not None:
            self.metrics.observe_finished(request, reason)
        self._deliver(choice, delta)

    def _deliver(self, choice: _Choice, delta: Delta) -> None:
        choice.submission.loop.call_soon_threadsafe(choice.submission.deliver, delta)

    def _publish_snapshot(self) -> None:
        if self.metrics is not None:
            self.metrics.update(self.engine.get_metrics())


def _child_params(params: dict[str, Any], i: int) -> dict[str, Any]:
    """Choice i of n: the same params, but a distinct seed so samples differ."""
    if i == 0 or params.get("seed") is None:
        return params
    return {**params, "seed": params["seed"] + i}


def _new_logprobs(choice: _Choice) -> list[dict[int, float]] | None:
    request = choice.request
    if request.sampling_params.logprobs is None:
        return None
    return request.logprobs[choice.num_sent_tokens:]


def apply_chat_template(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template: use /v1/completions instead")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
