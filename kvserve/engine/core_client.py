"""The API server's handle on an engine core: start it, send it batched
inputs, receive its step outputs on the event loop, notice when it dies.

`ProcessCoreClient` spawns the core as its own process (multiprocessing
'spawn': CUDA-safe, and the core's Python does not share the API server's
GIL) and talks to it over two ZeroMQ sockets on ipc:// paths: PUSH inputs,
PULL outputs. `ThreadCoreClient` runs the same core loop on a thread, for an
LLMEngine built in this process. Both call `on_outputs(CoreOutputs)` on the
event loop, and `on_exit(reason)` once if the core stops without being told.
Both answer `debug_snapshot()` (GET /debug/kvserve) and `profile(action)`
(POST /start_profile, /stop_profile) by asking the core.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import shutil
import tempfile
import threading
from typing import Any, Callable

from kvserve.engine.core_process import CoreInfo, EngineCore, ThreadTransport, run_core_process
from kvserve.engine.core_protocol import Codec, CoreInputs, CoreOutputs, ProfileCommand

logger = logging.getLogger(__name__)

OnOutputs = Callable[[CoreOutputs], None]
OnExit = Callable[[str], None]


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """loop.call_soon_threadsafe that tolerates a loop already closed (shutdown)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _profile_inputs(action: str) -> Callable[[str], CoreInputs]:
    return lambda query_id: CoreInputs(profile=[ProfileCommand(query_id, action)])


class DebugQueries:
    """Debug snapshots asked of the core and not yet answered, by query id."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()

    async def ask(self, send: Callable[[CoreInputs], None], timeout_s: float,
                  inputs: Callable[[str], CoreInputs] = lambda q: CoreInputs(debug=[q])) -> dict[str, Any]:
        """The core's reply to `inputs(query_id)`: a debug snapshot unless told otherwise."""
        query_id = f"q{next(self._ids)}"
        future = self._waiting[query_id] = asyncio.get_running_loop().create_future()
        send(inputs(query_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._waiting.pop(query_id, None)

    def failing(self, on_exit: OnExit) -> OnExit:
        """on_exit, after failing every query still waiting: a core that died answers none
        of them, and a route must not wait out its timeout for it."""
        def fail(reason: str) -> None:
            waiting, self._waiting = self._waiting, {}
            for future in waiting.values():
                if not future.done():
                    future.set_exception(RuntimeError(reason))
            on_exit(reason)
        return fail

    def answering(self, on_outputs: OnOutputs) -> OnOutputs:
        """on_outputs, after resolving the debug replies a message carries."""
        def deliver(message: CoreOutputs) -> None:
            for reply in message.debug:
                future = self._waiting.pop(reply.query_id, None)
                if future is not None and not future.done():
                    future.set_result(reply.snapshot)
            on_outputs(message)
        return deliver


class ThreadCoreClient:
    """The core loop on a thread of this process, over an already built engine."""

    def __init__(self, engine) -> None:
        self.info = CoreInfo.of(engine)
        self._engine = engine
        self._transport: ThreadTransport | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._debug = DebugQueries()

    def start(self, on_outputs: OnOutputs, on_exit: OnExit) -> None:
        loop = asyncio.get_running_loop()
        on_outputs = self._debug.answering(on_outputs)
        self._transport = ThreadTransport(lambda out: _call_soon(loop, on_outputs, out))
        self._thread = threading.Thread(target=self._run, args=(loop, self._debug.failing(on_exit)),
                                        name="kvserve-engine",
                                        daemon=True)
        self._thread.start()

    def _run(self, loop: asyncio.AbstractEventLoop, on_exit: OnExit) -> None:
        try:
            EngineCore(self._engine, self._transport).serve()
        except BaseException as e:  # logged and reported to the API side by serve()
            reason = f"the engine failed: {type(e).__name__}: {e}"
        else:
            reason = "the engine thread stopped"
        if not self._stopping:
            _call_soon(loop, on_exit, reason)

    def send(self, inputs: CoreInputs) -> None:
        self._transport.inputs.put(inputs)

    async def debug_snapshot(self, timeout_s: float) -> dict[str, Any]:
        return await self._debug.ask(self.send, timeout_s)

    async def profile(self, action: str, timeout_s: float) -> dict[str, Any]:
        return await self._debug.ask(self.send, timeout_s, _profile_inputs(action))

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopping = True
        if self._thread is not None:
            self.send(CoreInputs(shutdown=True))
            self._thread.join(timeout=10)


class ProcessCoreClient:
    """The core in a spawned process; blocks in __init__ until its engine is built."""

    def __init__(self, args, engine_hook: Callable[[Any], None] | None = None) -> None:
        import zmq
        import zmq.asyncio
        self._zmq = zmq
        self._dir = tempfile.mkdtemp(prefix="kvserve-core-")
        # Inputs go out from the event loop thread with a plain non-blocking send;
        # outputs are awaited on the event loop (the socket binds to it at first use).
        self._contexts = (zmq.Context(io_threads=1), zmq.asyncio.Context(io_threads=1))
        self._inputs = self._bind(self._contexts[0], zmq.PUSH, "inputs")
        self._outputs = self._bind(self._contexts[1], zmq.PULL, "outputs")
        self._codec = Codec(CoreOutputs)
        self._stopping = False
        self._reader: asyncio.Task | None = None
        self._debug = DebugQueries()
        try:
            self.process, self.info = self._spawn(args, engine_hook)
        except BaseException:
            self._close_sockets()
            raise

    def _bind(self, context, kind: int, name: str):
        socket = context.socket(kind)
        socket.setsockopt(self._zmq.LINGER, 0)
        # Unbounded queues: the API side must never block on, or drop, a message.
        socket.setsockopt(self._zmq.SNDHWM if kind == self._zmq.PUSH else self._zmq.RCVHWM, 0)
        socket.bind(f"ipc://{self._dir}/{name}")
        return socket

    def _spawn(self, args, engine_hook) -> tuple[multiprocessing.Process, CoreInfo]:
        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=run_core_process, name="kvserve-engine-core", daemon=True,
            args=(args, f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/outputs", writer,
                  logging.getLogger().getEffectiveLevel(), engine_hook))
        process.start()
        writer.close()
        try:
            return process, _wait_ready(process, reader)
        except BaseException:
            process.kill()
            process.join()
            raise

    # -- on the event loop -----------------------------------------------------------
    def start(self, on_outputs: OnOutputs, on_exit: OnExit) -> None:
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(self._debug.answering(on_outputs)))
        threading.Thread(target=self._watch, args=(loop, self._debug.failing(on_exit)),
                         name="kvserve-core-watch", daemon=True).start()

    async def _read(self, on_outputs: OnOutputs) -> None:
        while True:
            frame = await self._outputs.recv(copy=False)
            try:
                on_outputs(self._codec.decode(frame.buffer))
            except Exception:  # the reader must outlive a bad message, or every request hangs
                logger.exception("could not process engine core outputs")

    def _watch(self, loop: asyncio.AbstractEventLoop, on_exit: OnExit) -> None:
        multiprocessing.connection.wait([self.process.sentinel])
        self.process.join(timeout=5)
        if not self._stopping:
            _call_soon(loop, on_exit, f"the engine core process exited with code {self.process.exitcode}")

    def send(self, inputs: CoreInputs) -> None:
        try:
            self._inputs.send(self._codec.encode(inputs), self._zmq.NOBLOCK, copy=False)
        except self._zmq.Again:   # no core connected: it died; the watcher reports that
            logger.warning("engine core is not connected; dropped %d add(s), %d abort(s)",
                           len(inputs.adds), len(inputs.aborts))

    async def debug_snapshot(self, timeout_s: float) -> dict[str, Any]:
        return await self._debug.ask(self.send, timeout_s)

    async def profile(self, action: str, timeout_s: float) -> dict[str, Any]:
        return await self._debug.ask(self.send, timeout_s, _profile_inputs(action))

    @property
    def is_alive(self) -> bool:
        return not self._exited(0)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def shutdown(self) -> None:
        self._stopping = True
        if not self._exited(0):
            self.send(CoreInputs(shutdown=True))
        if not self._exited(10):
            logger.warning("engine core did not stop in 10 s; killing it")
            self.process.kill()
            self._exited(5)
        if self._reader is None:   # no watcher thread was started to reap it
            self.process.join(timeout=5)
        else:
            self._reader.cancel()
        self._close_sockets()

    def _exited(self, timeout_s: float) -> bool:
        """Whether the core process has ended, read from its sentinel. Only the
        watcher thread reaps it (`join`): a second thread's `join` or
        `is_alive` races that waitpid, could see the ended process as alive,
        and then kill a pid that is no longer its."""
        return bool(multiprocessing.connection.wait([self.process.sentinel], timeout_s))

    def _close_sockets(self) -> None:
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        for context in self._contexts:
            context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _wait_ready(process: multiprocessing.Process, reader) -> CoreInfo:
    """The core's CoreInfo, or its start-up error raised here. Building the
    engine may take minutes (weights, graph capture): wait while it lives."""
    while not reader.poll(0.5):
        if not process.is_alive():
            raise RuntimeError(f"the engine core process exited with code {process.exitcode} "
                               f"before it was ready")
    try:
        kind, payload = reader.recv()
    except EOFError as e:
        raise RuntimeError("the engine core process closed its pipe before it was ready") from e
    finally:
        reader.close()
    if kind == "error":
        raise RuntimeError(f"the engine core failed to start: {payload}")
    return payload
