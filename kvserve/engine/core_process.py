"""The engine core: the loop that owns an LLMEngine, takes batched inputs and
answers with one message per step. It runs in its own process for
`kvserve serve` (`run_core_process`, started with multiprocessing 'spawn' so
CUDA is never forked) or on a thread of the API process (`ThreadTransport`,
for an engine built in-process).

The core never sees text: requests arrive as token ids, and stop strings are
left to the API side (which aborts a request once its text hits one). Adding a
job validates every request with `LLMEngine.make_request` first and answers
accept or reject at once, before the next step, so the API side can return a
400 from `submit`.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import msgspec
import torch

from kvserve.diagnose.endpoint import engine_snapshot
from kvserve.engine.gc_heap import freeze_startup_heap
from kvserve.engine.step_trace import StepProfile, StepTrace, enable_sync_check_from_env, now
from kvserve.engine.core_protocol import (
    Codec, CoreInputs, CoreJob, CoreOutput, CoreOutputs, DebugReply, ProfileCommand, Rejection,
    salvage_inputs, unpack_sampling_params)
from kvserve.engine.device_profile import CoreProfiler, profiler_dir
from kvserve.request import FINISHED_STATUSES, RUNNING

logger = logging.getLogger(__name__)

# A metrics snapshot rides along with step outputs at most this often (and
# once whenever the core goes idle), so get_metrics never runs per step.
METRICS_INTERVAL_S = 0.1
# How long an idle core waits for input before checking that its parent lives.
IDLE_POLL_S = 1.0


@dataclass
class CoreInfo:
    """What the API side needs of the engine, sent once when the core is ready."""
    tokenizer: Any
    scheduler_config: Any
    model_config: Any
    eos_token_ids: frozenset[int]
    cache_info: dict[str, str]

    @classmethod
    def of(cls, engine) -> "CoreInfo":
        from kvserve.server.metrics import cache_info
        return cls(engine.tokenizer, engine.scheduler_config, engine.model_config, engine.eos_token_ids,
                   cache_info(engine))

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's token ids, as LLMEngine.encode_prompt makes them
        (with the tokenizer's special tokens, as vLLM does)."""
        if not text:
            raise ValueError("prompt must not be empty")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as a list of token ids")
        return list(self.tokenizer.encode(text, add_special_tokens=True))


class Transport(Protocol):
    def recv(self, timeout_s: float | None) -> list[CoreInputs]:
        """Every input waiting; waits up to timeout_s (None: forever, 0: not at all) for the first."""

    def send(self, outputs: CoreOutputs) -> None: ...


class EngineCore:
    """Applies inputs, steps the engine, and reports what changed."""

    def __init__(self, engine, transport: Transport) -> None:
        self.engine = engine
        self.transport = transport
        self._num_sent: dict[str, int] = {}   # request id -> output tokens already reported
        self._last_metrics = 0.0
        self._idle_reported = False
        self._grammar_tokenizer = None   # xgrammar.TokenizerInfo, built at the first grammar
        self._trace = StepTrace.from_env()
        if self._trace is not None:   # the trace's device span column (CUDA events around each step)
            self.engine.runner.time_steps = getattr(engine.runner, "device", torch.device("cpu")).type == "cuda"
        self._profile = StepProfile.from_env()
        directory = profiler_dir()
        self._device_profiler = CoreProfiler(directory) if directory else None

    def serve(self, idle_check: Callable[[], bool] = lambda: True) -> None:
        """Run until a shutdown input arrives or `idle_check` says stop. An
        exception is reported to the API side, then re-raised."""
        try:
            while self.run_once(idle_check):
                pass
        except BaseException as e:
            logger.exception("engine core failed")
            self.transport.send(CoreOutputs(error=f"{type(e).__name__}: {e}"))
            raise
        finally:
            if self._trace is not None:
                self._trace.close()
            if self._profile is not None:
                self._profile.flush()
            if self._device_profiler is not None:
                self._device_profiler.close(self.engine.stats.num_steps)

    def run_once(self, idle_check: Callable[[], bool] = lambda: True) -> bool:
        """One turn: apply waiting inputs, then step if anything is unfinished.
        False once a shutdown input arrived (or, idle, when idle_check says stop)."""
        busy = self.engine.has_unfinished_requests()
        if not busy:
            self._report_idle()
        inputs = self.transport.recv(0 if busy else IDLE_POLL_S)
        if not inputs and not busy:
            return idle_check()
        replies = CoreOutputs()
        for message in inputs:
            if message.shutdown:
                return False
            self._apply(message, replies)
        if replies.accepted or replies.rejected or replies.debug:
            self.transport.send(replies)   # before the step: submit waits on it
        if self.engine.has_unfinished_requests():
            self._step()
        return True

    # -- inputs --------------------------------------------------------------------
    def _apply(self, message: CoreInputs, replies: CoreOutputs) -> None:
        for job_id, why in message.unreadable:
            logger.error("rejected job %s: the core could not read it: %s", job_id, why)
            replies.rejected.append(Rejection(job_id, f"the engine core could not read this job: {why}",
                                              invalid=False))
        for job in message.adds:
            self._add(job, replies)
        for request_id in message.aborts:
            self._num_sent.pop(request_id, None)
            self.engine.abort_request(request_id)
        if message.debug:   # built only when asked: never on the step path
            replies.debug.extend(DebugReply(q, engine_snapshot(self.engine)) for q in message.debug)
        if message.profile:
            replies.debug.extend(DebugReply(c.query_id, self._profile_command(c)) for c in message.profile)
        if (message.adds or message.aborts) and self._idle_reported:
            self._idle_reported = False
            self._last_metrics = float("-inf")   # the first busy step reports: no idle snapshot outlives it

    def _profile_command(self, command: ProfileCommand) -> dict[str, Any]:
        if self._device_profiler is None:
            return {"error": "profiling is off in the engine core: start the server with "
                             "KVSERVE_TORCH_PROFILER_DIR set"}
        try:
            return self._device_profiler.command(command.action, self.engine.stats.num_steps)
        except Exception as e:  # a profiler that fails (a full disk, say) fails the command, not the core
            logger.exception("profiler command %r failed", command.action)
            return {"error": f"the profiler failed: {type(e).__name__}: {e}"}

    def _add(self, job: CoreJob, replies: CoreOutputs) -> None:
        try:
            requests = []
            for r in job.requests:
                params = unpack_sampling_params(r.sampling_params, r.grammar_json, self._load_grammar)
                request = self.engine.make_request(r.prompt_token_ids, params, r.request_id, r.cache_salt)
                request.arrival_time = r.arrival_time
                requests.append(request)
        except ValueError as e:
            replies.rejected.append(Rejection(job.job_id, str(e), invalid=True))
            return
        except Exception as e:  # still this job's fault, not the engine's
            replies.rejected.append(Rejection(job.job_id, f"{type(e).__name__}: {e}", invalid=False))
            return
        for request in requests:
            self.engine.add_request(request)
            self._num_sent[request.request_id] = 0
        replies.accepted.append(job.job_id)

    def _load_grammar(self, grammar_json: str) -> Any:
        """A compiled grammar from its JSON, against this engine's tokenizer
        (the same TokenizerInfo the API side compiled it with)."""
        import xgrammar
        if self._grammar_tokenizer is None:
            engine = self.engine
            self._grammar_tokenizer = xgrammar.TokenizerInfo.from_huggingface(
                engine.tokenizer, vocab_size=engine.model_config.vocab_size,
                stop_token_ids=sorted(engine.eos_token_ids))
        return xgrammar.CompiledGrammar.deserialize_json(grammar_json, self._grammar_tokenizer)

    # -- outputs -------------------------------------------------------------------
    def _step(self) -> None:
        if self._profile is None:
            return self._traced_step()
        with self._profile:
            self._traced_step()

    def _traced_step(self) -> None:
        start = now()
        touched = self.engine.step(emit=self._send_tokens)
        stepped = now()
        self._send_tokens(touched)
        if self._trace is not None:
            self._trace.record(start, stepped - start, self.engine.last_wait_s, now() - stepped, self.engine)

    def _send_tokens(self, touched: list) -> None:
        """The new tokens of `touched` as one message: after each step, and from inside a
        step for the tokens it read before a long launch (out now, not after it)."""
        self._send(self._outputs(touched))

    def _send(self, message: CoreOutputs) -> None:
        """The step's message, with a metrics snapshot at most every METRICS_INTERVAL_S."""
        clock = time.monotonic()
        if clock - self._last_metrics >= METRICS_INTERVAL_S:
            message.metrics, self._last_metrics = self.engine.get_metrics(), clock
        if message.outputs or message.next_ids or message.metrics is not None:
            self.transport.send(message)

    def _outputs(self, touched: list) -> CoreOutputs:
        """One message for the step. A running request's plain next tokens (no
        logprobs, not its first output, not finishing: nearly every request on
        nearly every step) go into the two columns; the rest get a CoreOutput."""
        message = CoreOutputs()
        next_ids, next_tokens, num_sent = message.next_ids, message.next_tokens, self._num_sent
        for request in touched:
            sent = num_sent.get(request.request_id)
            if sent is None:   # aborted by the API side meanwhile
                continue
            # `status not in`, not the `is_finished` property: a call less per request per step
            status = request.status
            if sent and request.sampling_params.logprobs is None and (status is RUNNING or status not in FINISHED_STATUSES):
                tokens = request.output_token_ids[sent:]
                num_sent[request.request_id] = sent + len(tokens)
                next_ids.append(request.request_id)
                next_tokens.append(tokens)
            else:
                message.outputs.append(self._output(request, sent))
        return message

    def _output(self, request, sent: int) -> CoreOutput:
        ids = request.output_token_ids
        logprobs = request.logprobs[sent:] if request.sampling_params.logprobs is not None else None
        first = sent == 0
        out = CoreOutput(request.request_id, ids[sent:], logprobs,
                         num_cached_tokens=max(request.num_cached_tokens, 0),
                         scheduled_time=request.first_scheduled_time if first else None)
        if first and request.sampling_params.prompt_logprobs is not None:
            out.prompt_logprobs = list(request.prompt_logprobs)
        if request.is_finished:
            out.finish_reason = request.status.value
            out.stop_reason = request.stop_reason if isinstance(request.stop_reason, int) else None
            del self._num_sent[request.request_id]
        else:
            self._num_sent[request.request_id] = len(ids)
        return out

    def _report_idle(self) -> None:
        """A final snapshot when work stops: /metrics must show an idle engine as idle."""
        if not self._idle_reported:
            self._idle_reported = True
            self._last_metrics = time.monotonic()
            self.transport.send(CoreOutputs(metrics=self.engine.get_metrics()))


# -- the core on a thread of the API process ---------------------------------------
class ThreadTransport:
    """Queues between the API event loop and an engine thread (no encoding)."""

    def __init__(self, deliver: Callable[[CoreOutputs], None]) -> None:
        self.inputs: queue.SimpleQueue[CoreInputs] = queue.SimpleQueue()
        self._deliver = deliver

    def recv(self, timeout_s: float | None) -> list[CoreInputs]:
        try:
            first = self.inputs.get_nowait() if timeout_s == 0 else self.inputs.get(timeout=timeout_s)
        except queue.Empty:
            return []
        items = [first]
        while True:
            try:
                items.append(self.inputs.get_nowait())
            except queue.Empty:
                return items

    def send(self, outputs: CoreOutputs) -> None:
        self._deliver(outputs)


# -- the core in its own process -----------------------------------------------------
class ZmqTransport:
    """The core's end of the two sockets: PULL inputs, PUSH outputs."""

    def __init__(self, input_address: str, output_address: str) -> None:
        import zmq
        self._zmq = zmq
        self._context = zmq.Context(io_threads=1)
        self._inputs = self._context.socket(zmq.PULL)
        self._inputs.connect(input_address)
        self._outputs = self._context.socket(zmq.PUSH)
        self._outputs.setsockopt(zmq.SNDHWM, 0)   # never drop or block on a slow reader
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.connect(output_address)
        self._in_codec, self._out_codec = Codec(CoreInputs), Codec(CoreOutputs)

    def recv(self, timeout_s: float | None) -> list[CoreInputs]:
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if timeout_ms != 0 and not self._inputs.poll(timeout_ms):
            return []
        items = []
        while True:
            try:
                frame = self._inputs.recv(self._zmq.NOBLOCK, copy=False)
            except self._zmq.Again:
                return items
            items.append(self._decode(frame.buffer))

    def _decode(self, buffer: memoryview) -> CoreInputs:
        try:
            return self._in_codec.decode(buffer)
        except msgspec.ValidationError:
            return salvage_inputs(buffer)

    def send(self, outputs: CoreOutputs) -> None:
        self._outputs.send(self._out_codec.encode(outputs), copy=False)

    def close(self) -> None:
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()


def run_core_process(args, input_address: str, output_address: str, ready, log_level: int,
                     engine_hook: Callable[[Any], None] | None = None) -> None:
    """Entry point of the core process: build the engine from `args`, send
    CoreInfo (or the start-up error) through `ready`, then serve until told to
    stop or until the parent process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the API server, which stops us
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [core]: %(message)s")
    transport = ZmqTransport(input_address, output_address)
    try:
        engine = _build_engine(args, ready, engine_hook)
        if engine is None:
            return
        parent = os.getppid()
        EngineCore(engine, transport).serve(idle_check=lambda: os.getppid() == parent)
    finally:
        transport.close()


def limit_host_threads(engine) -> None:
    """One torch CPU thread for a core that drives a GPU (as vLLM's workers
    do), unless OMP_NUM_THREADS says otherwise. Its host ops are small; an
    intra-op pool only contends with the API server's and the clients'
    processes, and waking it cost 4.4 ms a mixed step in a served H200 run.
    A CPU engine computes on those threads and keeps them."""
    threads = torch.get_num_threads()
    if engine.runner.device.type != "cuda" or "OMP_NUM_THREADS" in os.environ or threads == 1:
        return
    logger.info("torch CPU threads %d -> 1: the core's host ops are small and other processes "
                "share the CPU (set OMP_NUM_THREADS to choose)", threads)
    torch.set_num_threads(1)


def _build_engine(args, ready, engine_hook):
    from kvserve.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(args)
        if engine_hook is not None:
            engine_hook(engine)
        limit_host_threads(engine)
        freeze_startup_heap()
        if enable_sync_check_from_env():   # after start-up, whose memory profile syncs on purpose
            logger.info("sync check on: each call that waits for the device warns once, with its line")
        ready.send(("ready", CoreInfo.of(engine)))
        return engine
    except Exception as e:
        ready.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return None
    finally:
        ready.close()
