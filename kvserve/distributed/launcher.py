"""The driver's side of tensor parallelism: start-up checks, spawning ranks
1..N-1, the step channel the runner publishes to, and shutdown.

The driver is rank 0 and is the engine itself (the `LLM` process, or the
server's engine-core process): the scheduler, the KV cache manager and the
sampler live beside rank 0's forward, so a step costs the driver no extra
process hop, and one GPU is exactly the engine without this module.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import weakref
from typing import Any, Iterator

import torch

from kvserve.config import EngineArgs
from kvserve.distributed.group import TPGroup, connect, make_store
from kvserve.distributed.sharding import validate_tp
from kvserve.distributed.step_channel import StepPublisher
from kvserve.distributed.worker import run_worker
from kvserve.model.config import ModelConfig
from kvserve.runner.batch import ModelInputs

logger = logging.getLogger(__name__)

# How long a stopping worker may take to leave its loop before it is terminated.
STOP_TIMEOUT_S = 10.0


def check_devices(size: int, device: torch.device) -> None:
    """Raise ValueError (naming the values) unless `size` alike GPUs are visible."""
    if device.type != "cuda":
        return
    if device.index not in (None, 0):
        raise ValueError(f"with tensor_parallel_size={size} the ranks use cuda:0..cuda:{size - 1}; "
                         f"got device={str(device)!r} (choose GPUs with CUDA_VISIBLE_DEVICES)")
    visible = torch.cuda.device_count()
    if size > visible:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs but {visible} are visible")
    names = [torch.cuda.get_device_name(i) for i in range(size)]
    if len(set(names)) > 1:
        raise ValueError(f"tensor parallelism needs the same GPU model on every rank; got {names}")


def start_workers(args: EngineArgs, config: ModelConfig, device: torch.device) -> "TPDriver":
    """Check the configuration, spawn ranks 1..N-1 and join the group as rank 0."""
    size = args.tensor_parallel_size
    validate_tp(config, size)
    check_devices(size, device)
    store = make_store(0, size)
    workers = _Workers(*_spawn(args, size, store.port, device.type))
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    try:
        group = connect(store, 0, size, device)
    except BaseException:
        workers.stop(None)
        raise
    return TPDriver(group, workers, store)


def _spawn(args: EngineArgs, size: int, port: int, device_type: str) -> tuple[list[Any], list[Any]]:
    ctx = torch.multiprocessing.get_context("spawn")
    processes, errors = [], []
    with _children_allowed():
        for rank in range(1, size):
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=run_worker, args=(args, rank, size, port, device_type, writer),
                                  name=f"kvserve-tp-rank{rank}", daemon=True)
            process.start()
            writer.close()
            processes.append(process)
            errors.append(reader)
    return processes, errors


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """The server's engine core is a daemonic process (it must die with the API
    server), and multiprocessing refuses children to daemons lest they outlive
    them. Workers watch their parent and exit with it, so they may be started."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


class TPDriver:
    """Rank 0's handle on the worker ranks, and the runner's step channel.
    Stops the workers on `close`, when it is collected, or at exit."""

    def __init__(self, group: TPGroup, workers: "_Workers", store: Any) -> None:
        self.group = group
        self._store = store  # rank 0 hosts the store the groups met at
        self._publisher = StepPublisher(group)
        self._workers = workers
        self._finalizer = weakref.finalize(self, workers.stop, self._publisher)
        workers.watch(fatal=group.device.type == "cuda")

    def start_serving(self) -> None:
        """From now on every logits computation here is announced to the workers.
        (During start-up every rank runs the same profile step on its own.)"""
        self.group.announce_logits = self._publisher.announce_logits

    def publish(self, inputs: ModelInputs) -> None:
        self._publisher.publish(inputs)

    def close(self) -> None:
        self._finalizer()

    def raise_worker_error(self, cause: BaseException) -> None:
        """Raise the first error a worker reported (if any), chained to `cause`."""
        reported = self._workers.reported_errors()
        if reported:
            raise RuntimeError(f"tensor-parallel worker failed: {reported[0]}") from cause


class _Workers:
    """The worker processes and their error pipes (no reference to the driver,
    so the driver's finalizer can stop them)."""

    def __init__(self, processes: list[Any], errors: list[Any]) -> None:
        self.processes, self.errors = processes, errors
        self.stopping = False
        self._reported: list[str] = []

    def watch(self, fatal: bool) -> None:
        threading.Thread(target=self._watch, args=(fatal,), name="kvserve-tp-watch", daemon=True).start()

    def _watch(self, fatal: bool) -> None:
        """A worker that dies mid-run leaves rank 0 waiting in a collective: on
        CPU gloo raises there; NCCL would hang, so on CUDA the engine exits."""
        multiprocessing.connection.wait([p.sentinel for p in self.processes])
        if self.stopping:
            return
        dead = [(p.name, p.exitcode) for p in self.processes if not p.is_alive()]
        logger.error("tensor-parallel worker(s) exited: %s; reported: %s", dead, self.reported_errors())
        if fatal:
            os._exit(1)

    def reported_errors(self) -> list[str]:
        """What failed workers sent before exiting ("rank r: Error: message")."""
        for reader in self.errors:
            with contextlib.suppress(EOFError, OSError):
                while reader.poll():
                    self._reported.append(reader.recv())
        return list(self._reported)

    def stop(self, publisher: StepPublisher | None) -> None:
        self.stopping = True
        if publisher is not None:
            publisher.group.announce_logits = None  # nobody listens any more
            if all(p.is_alive() for p in self.processes):
                with contextlib.suppress(Exception):
                    publisher.stop()
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(1.0)
