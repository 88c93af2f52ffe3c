"""LLMEngine: request intake and validation, the step loop, stop conditions,
detokenization and metrics. Owns the scheduler and the model runner; knows
nothing about blocks (the KV cache manager does) or kernels (the backend does).
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from operator import attrgetter
from typing import Any, Callable

from kvserve.config import EngineArgs
from kvserve import detokenizer
from kvserve.diagnose.recorder import RequestRecorder
from kvserve.engine.builder import EngineParts, build_engine_parts
from kvserve.inputs import surrogate_error
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, prompt_logprobs_of
from kvserve.request import FINISHED_STATUSES, RUNNING, Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.runner.model_runner import InFlightStep, StepResult
from kvserve.runner.prompt_logprobs import PromptLogprobs
from kvserve.runner.sampler import RequestFailed, SamplerOutput
from kvserve.scheduler import SchedulerOutput, row_request_id

logger = logging.getLogger(__name__)

_num_computed = attrgetter("num_computed_tokens")

# Steps in a row that may fail without a culprit before the engine gives up
# (the error is then raised to the caller: the engine cannot serve).
MAX_CONSECUTIVE_STEP_FAILURES = 3


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        parts: EngineParts = build_engine_parts(args)
        self.args = args
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.scheduler_config = parts.scheduler_config
        self.kv_cache = parts.kv_cache
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.eos_token_ids = parts.eos_token_ids
        self.requests: dict[str, Request] = {}
        self._in_flight: InFlightStep | None = None
        self.prompt_logprobs = PromptLogprobs()   # requests whose prompt logprobs are still to compute
        self._ids = itertools.count()
        self.stats = EngineStats()
        self._num_failed_steps = 0
        self.last_wait_s = 0.0   # the last step's wait for its predecessor's ids (engine/step_trace.py)
        self.last_gpu_ms = float("nan")   # the device span of the step the last `step` resolved (timed runs)
        self.recorder = RequestRecorder(self.kv_cache.block_size)  # reuse + timelines for diagnose

    # -- intake --------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, cache_salt: str | None = None) -> Request:
        """Tokenize and validate; raises ValueError naming the limit. Does not enqueue.
        `cache_salt` (vLLM's): only requests with the same salt share cached prefixes."""
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        return Request(request_id=request_id or self.new_request_id(), prompt_token_ids=token_ids,
                       sampling_params=params, prompt=text, eos_token_ids=self.eos_token_ids, cache_salt=cache_salt)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.set_token_checks(self.scheduler_config.max_model_len)
        self.runner.sampler.track(request)
        self.prompt_logprobs.track(request)
        self.recorder.on_arrival(request)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self._forget(request)
            self._start_write_backs()

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a text prompt as vLLM makes them: with the tokenizer's
        special tokens (a BOS where the tokenizer adds one). Chat prompts come
        from the chat template, which writes its own BOS, as token ids."""
        if not text:
            raise ValueError("prompt must not be empty")
        if bad := surrogate_error(text):
            raise ValueError(f"prompt{bad}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode_prompt(prompt)
        token_ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)   # an array: Python ints
        if not token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        return None, token_ids

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        max_len = self.scheduler_config.max_model_len
        total = len(token_ids) + params.max_tokens
        if len(token_ids) >= max_len or total > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{total} exceeds max_model_len={max_len}")
        needed = self.kv_cache.num_blocks_needed(total, self.scheduler_config.max_num_batched_tokens)
        usable = self.kv_cache.num_usable_blocks
        if needed > usable:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                             f"{needed} KV blocks but the whole cache has {usable}; raise num_kv_blocks "
                             f"or kv_cache_memory_gb, or shorten the request")

    # -- the step loop -----------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    def step(self, emit: Callable[[list[Request]], None] | None = None) -> list[Request]:
        """Launch the next step, then finish the one before it.

        Steps are pipelined one deep: step N+1 is scheduled and queued on the
        device before step N's sampled ids are read back, so host work (the
        scheduler, batch building, stop checks) overlaps device work; a long
        eager step is prepared (inputs built and uploaded), queues its first
        layers, then reads step N's ids before it queues the rest
        (`_drain_before_long_launch`). Returns the requests that got a new
        token. With `emit`, the requests such a drain gave a token go to `emit`
        before the rest of the long launch (tens of ms of host time, a whole
        step's when the launch queue fills) instead of into the returned list.
        """
        self.last_wait_s = 0.0
        out = self.scheduler.schedule()
        if out.is_empty:
            self.runner.copy_blocks(out.kv_copies)  # a swap-out with nothing scheduled
            touched = self._finish_in_flight(None)
            self._start_write_backs()
            return touched
        start = time.monotonic()
        tables = self.kv_cache.block_tables(out.request_ids or list(map(row_request_id, out.scheduled)),
                                            out.previous_rows)
        drained: list[Request] = []
        drain = functools.partial(self._drain_before_long_launch, emit, drained) \
            if self._drains_before(out) else None
        try:
            inputs = self.runner.prepare(out, tables, self._in_flight)
            launched = self.runner.run(inputs, out, self.prompt_logprobs, drain)
        except Exception as e:  # this step advanced nothing (a drain may have finished the one before):
            # its survivors are scheduled again next step
            return drained + self._on_step_error(e, [s.request for s in out.scheduled])
        self._num_failed_steps = 0
        self.scheduler.update_after_step(out, launched.rows)
        touched = drained + self._finish_in_flight(launched)
        self._start_write_backs()
        self.stats.record_step(out, time.monotonic() - start)
        self._observe_rates()
        return touched

    def _drains_before(self, out: SchedulerOutput) -> bool:
        """Whether `out` runs eagerly with many tokens (`ModelRunner.drain_above_tokens`)
        while a step is in flight: then `_drain_before_long_launch` runs inside its launch."""
        limit = self.runner.drain_above_tokens
        return not (limit is None or out.decode is not None or self._in_flight is None
                    or out.num_tokens <= limit)

    def _drain_before_long_launch(self, emit: Callable[[list[Request]], None] | None,
                                  drained: list[Request]) -> None:
        """Inside the launch of a step that runs eagerly with many tokens (its inputs are
        already on the device, its first layers queued: `ModelRunner.run`), finish the step
        in flight: its requests that got a token go to `emit`, or into `drained` without one.
        Such a launch (~600 kernels) fills the device's launch queue: the host would block
        in it until most of the step before had run, and only then read that step's tokens,
        a whole long step late (the served mixed burst's 200-480 ms host stalls, all in such
        launches). Finished before the rest is queued, the tokens go out as soon as they
        exist, and the device runs the first layers meanwhile instead of idling (the mixed
        burst offline, 23 such steps: 49-57 ms from upload to first kernel when the whole
        launch waited for the drain, 3 ms since).
        The step keeps rows of requests that the finished step stopped, as a pipelined step
        does (their tokens are dropped)."""
        touched = self._finish_in_flight(None)
        if touched and emit is not None:
            emit(touched)
        else:
            drained.extend(touched)

    def _start_write_backs(self) -> None:
        """Blocks that finished requests just freed start their background
        copy to the host tier now, not a step later (and the counters see it)."""
        self.runner.copy_blocks(self.kv_cache.take_pending_copies())

    def _finish_in_flight(self, launched: InFlightStep | None) -> list[Request]:
        """Resolve the step in flight (if any) and make `launched` the new one."""
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return []
        start = time.perf_counter()
        try:
            result = previous.resolve()
        except Exception as e:  # its sampled tokens are lost: its rows cannot go on
            return self._on_step_error(e, [s.request for s in previous.rows])
        self.last_wait_s += time.perf_counter() - start   # a step may drain first (`step`): both waits count
        self.last_gpu_ms = previous.gpu_ms()
        return self._process(result)

    # -- fault isolation -----------------------------------------------------------
    def _on_step_error(self, error: Exception, involved: list[Request]) -> list[Request]:
        """Fail the requests an error belongs to, and only those; the engine goes on.

        A `RequestFailed` names its requests. Any other error fails every request
        of the step; after MAX_CONSECUTIVE_STEP_FAILURES such steps in a row the
        engine cannot serve, and the error is raised."""
        if isinstance(error, RequestFailed):
            culprits = [r for r in involved if r.request_id in set(error.request_ids)]
        else:
            self._num_failed_steps += 1
            if self._num_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise error
            culprits = involved
        logger.error("failing %d request(s) after an error in the engine step: %s",
                     len(culprits), error, exc_info=error)
        return [r for r in culprits if self.fail_request(r)]

    def fail_request(self, request: Request) -> bool:
        """Finish `request` with status "error" and free its KV; False if it had finished."""
        if request.is_finished or self.scheduler.abort_request(request.request_id) is None:
            return False
        request.status = RequestStatus.FINISHED_ERROR
        self._forget(request)
        return True

    def _observe_rates(self) -> None:
        """Feed measured prefill and copy rates to the swap-or-recompute choice."""
        transfer = self.runner.kv_transfer
        if transfer is None:
            return
        self.scheduler.costs.observe(self.stats.prefill_tokens_per_s(), transfer.measured_bytes_per_s())

    def _process(self, result: StepResult) -> list[Request]:
        """Append each row's sampled token to its request; finish those it
        ends. Hot: once per running request per step, so a token that can end
        nothing (`Request.set_token_checks`) costs an append and two tests."""
        now = time.monotonic()
        touched, skipped = [], 0
        sampled = result.sampled
        token_ids = sampled.token_ids
        for i, item in enumerate(result.rows):
            request = item.request
            status = request.status
            if status is not RUNNING and status in FINISHED_STATUSES:  # stopped or aborted while this step was in flight
                skipped += 1
                continue
            request.num_pending_tokens -= 1
            output = request.output_token_ids
            token = token_ids[i]
            output.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            if request.checks_each_token or token in request.stop_ids or len(output) >= request.max_output:
                if not self._check_token(request, sampled, i):
                    continue  # failed, not touched: `fail_request` sent its output
            touched.append(request)
        self.stats.num_generation_tokens += len(result.rows) - skipped
        return touched

    def _check_token(self, request: Request, sampled: SamplerOutput, i: int) -> bool:
        """Row i's token may end `request` (`_finish_status`): finish it then.
        False when the check raised and failing the request sent no output."""
        try:
            status = self._finish_status(request, sampled, i)
        except Exception as e:  # e.g. detokenizing: this request's error alone
            logger.error("request %s failed: %s", request.request_id, e, exc_info=e)
            return self.fail_request(request)
        if status is not None:
            self.scheduler.remove_finished(request, status)
            self.stats.record_finished(request)
            self.recorder.on_finished(request)
            self._forget(request)
        return True

    def _finish_status(self, request: Request, sampled: SamplerOutput, i: int) -> RequestStatus | None:
        """Row i's token, already appended: record its logprobs; the request's
        finish status, None while it goes on, in the order stop reasons take
        precedence."""
        token, params = request.output_token_ids[-1], request.sampling_params
        if params.logprobs is not None:
            request.cumulative_logprob += sampled.sampled_logprobs[i]
            request.logprobs.append(sampled.logprobs[i])
        if not params.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.stop_strings and self._hit_stop_string(request):
            return RequestStatus.FINISHED_STOPPED
        num_output = len(request.output_token_ids)
        if (num_output >= params.max_tokens
                or len(request.prompt_token_ids) + num_output >= self.scheduler_config.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _hit_stop_string(self, request: Request) -> bool:
        """A stop string ends in the new text (`detokenizer.find_stop`); the output is cut there."""
        text, params = self.output_text_so_far(request), request.sampling_params
        checked, request.stop_checked_chars = request.stop_checked_chars, len(text)
        at, stop = detokenizer.find_stop(text, checked, params.stop_strings, len(request.output_token_ids),
                                         params.min_tokens)
        if stop is not None:
            request.output_text, request.stop_reason = text[:at], stop
        return stop is not None

    def output_text_so_far(self, request: Request) -> str:
        """The request's output text as far as it is final (incremental, see
        kvserve/detokenizer.py); a trailing incomplete character is held back."""
        if self.tokenizer is None:
            return ""
        return detokenizer.advance(self.tokenizer, request.detokenizer, request.output_token_ids)

    def _forget(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self.runner.sampler.forget(request.request_id)
        self.prompt_logprobs.forget(request.request_id)

    # -- outputs -------------------------------------------------------------------
    def detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def make_output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        text = request.output_text if request.stop_reason is not None and isinstance(
            request.stop_reason, str) else self.detokenize(request.output_token_ids)
        finish_reason = request.status.value if finished else None
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(request.output_token_ids),
            cumulative_logprob=(request.cumulative_logprob
                                if request.sampling_params.logprobs is not None else None),
            logprobs=list(request.logprobs) if request.sampling_params.logprobs is not None else None,
            finish_reason=finish_reason, stop_reason=request.stop_reason)
        metrics = RequestMetrics(request.arrival_time, request.first_scheduled_time,
                                 request.first_token_time, request.finished_time, request.num_preemptions,
                                 request.timeline())
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             max(request.num_cached_tokens, 0), [completion], finished, metrics,
                             self._prompt_logprobs(request))

    def _prompt_logprobs(self, request: Request) -> list | None:
        """vLLM's RequestOutput.prompt_logprobs, decoded tokens included; None unless asked for."""
        if request.sampling_params.prompt_logprobs is None:
            return None
        tok = self.tokenizer
        # A prompt repeats tokens: decode each id once.
        decode = functools.lru_cache(maxsize=None)(lambda t: tok.decode([t])) if tok is not None else None
        return prompt_logprobs_of(request.prompt_token_ids, request.prompt_logprobs, decode)

    def get_metrics(self) -> dict[str, Any]:
        kv = self.kv_cache
        return {
            "kv_cache_usage_perc": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "kv_cache_evictions": kv.num_evictions,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_kv_rotations": self.scheduler.num_rotations,
            "num_load_ahead_admissions": self.scheduler.num_load_ahead,
            "num_prefix_overtakes": self.scheduler.num_prefix_overtakes,
            "kv_cache_fragmentation": kv.fragmentation(),
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            **self._group_metrics(),
            **kv.host_metrics(),
            **self._transfer_metrics(),
            **self.stats.as_dict(),
            **self.recorder.as_dict(),
        }

    def _group_metrics(self) -> dict[str, Any]:
        """Blocks per KV group, and KV bytes per token of context held by running requests."""
        groups = self.kv_cache.group_blocks()
        tokens = sum(map(_num_computed, self.scheduler.running))  # C-level: after every step
        held_bytes = sum(groups.values()) * self.runner.layout.bytes_per_block
        return {"kv_cache_group_blocks": groups, "kv_bytes_per_token": held_bytes / tokens if tokens else 0.0}

    def _transfer_metrics(self) -> dict[str, Any]:
        transfer = self.runner.kv_transfer
        if transfer is not None:
            # While steps run (a server snapshots after each), reading copy times
            # must not wait for the copies in flight: they count once landed.
            return transfer.metrics(wait=not self.has_unfinished_requests())
        return {"kv_host_blocks_to_host": 0, "kv_host_blocks_to_gpu": 0, "kv_host_bytes_to_host": 0,
                "kv_host_bytes_to_gpu": 0, "kv_host_blocks_prefetched": 0, "kv_host_load_wait_s": 0.0}


class EngineStats:
    """Cumulative counters the metrics exporters read; never reset."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.num_prompt_tokens = 0      # computed prompt tokens (recomputation included)
        self.num_generation_tokens = 0
        self.num_finished = 0
        self.prefill_time_s = 0.0
        self.step_time_s = 0.0
        self.last_prompt_tokens = 0     # the last step's (engine/step_trace.py)

    def record_step(self, out, seconds: float) -> None:
        self.num_steps += 1
        self.step_time_s += seconds
        # One pass over the batch: a step with any chunk of > 1 token counts as prefill time.
        # A decode step (`out.decode`) has none.
        prompt_tokens = 0 if out.decode is not None else sum(
            [n for s in out.scheduled if (n := s.num_new_tokens) > 1])
        self.last_prompt_tokens = prompt_tokens
        if prompt_tokens:
            self.prefill_time_s += seconds
        self.num_prompt_tokens += prompt_tokens

    def prefill_tokens_per_s(self) -> float | None:
        """Measured prefill throughput, once there is enough to measure."""
        if self.num_prompt_tokens < 1024 or self.prefill_time_s <= 0:
            return None
        return self.num_prompt_tokens / self.prefill_time_s

    def record_finished(self, request: Request) -> None:
        self.num_finished += 1

    def as_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "num_generation_tokens": self.num_generation_tokens,
                "num_requests_finished": self.num_finished, "prefill_time_s": self.prefill_time_s}
