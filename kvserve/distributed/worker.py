"""A worker rank's process (ranks 1..N-1): build this rank's model shard with
the driver's own start-up code, in lockstep with it, then run the forward of
every step the driver publishes until it says stop.

A worker has no scheduler, KV cache manager or sampler: it owns only its
share of the weights and of the KV heads. It exits with its parent.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import Any

import torch

from kvserve.config import EngineArgs
from kvserve.distributed.group import TPGroup, connect, make_store
from kvserve.distributed.step_channel import StepReceiver

logger = logging.getLogger(__name__)


def run_worker(args: EngineArgs, rank: int, size: int, port: int, device_type: str, errors: Any) -> None:
    """Entry point of a spawned worker; `errors` (a pipe) gets the text of a failure."""
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(levelname)s tensor-parallel rank {rank} %(name)s: %(message)s")
    try:
        group = connect(make_store(rank, size, port), rank, size, _rank_device(device_type, rank, size))
        runner = _build(args, group)
        config = runner.model.config
        follow_steps(runner, StepReceiver(group, runner.layout.block_size, config.hidden_size, runner.layout.dtype))
    except BaseException as error:
        errors.send(f"rank {rank}: {type(error).__name__}: {error}")
        raise


def _rank_device(device_type: str, rank: int, size: int) -> torch.device:
    if device_type == "cuda":
        from kvserve.runner.cuda_wait import set_cuda_wait
        set_cuda_wait(torch.device("cuda", rank))   # before set_device starts the context
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    # CPU ranks share the cores (tests): no rank should oversubscribe them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return torch.device("cpu")


def _build(args: EngineArgs, group: TPGroup):
    from kvserve.engine.builder import build_rank_model, build_runner
    from kvserve.model.loaders import resolve_model
    resolved = resolve_model(args.model, args.load_format, args.hf_overrides, with_tokenizer=False)
    return build_runner(args, build_rank_model(args, resolved, group.device, group))


@torch.inference_mode()
def follow_steps(runner, receiver: StepReceiver) -> None:
    """The driver's `launch`, less scheduling and sampling: the same forward
    (graph or eager, chosen from the same metadata), and this rank's part of
    each logits computation the driver announces."""
    while (message := receiver.receive()) is not None:
        if isinstance(message, torch.Tensor):
            runner.model.compute_logits(message)
        else:
            runner._forward(message)


def _exit_with_parent() -> None:
    """A worker blocked in a collective would outlive a killed driver."""
    parent = multiprocessing.parent_process()

    def watch() -> None:
        parent.join()
        os._exit(0)
    if parent is not None:
        threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()
