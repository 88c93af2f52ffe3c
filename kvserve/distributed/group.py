"""A tensor-parallel group: this rank's place in it and the collectives the
model and the step channel use.

Two communicators meet over one TCP store:
  - the device group (NCCL on CUDA, gloo on CPU) carries the model's
    all-reduces, the broadcast of a step's input ids and the gather of logits;
  - the host group (gloo) carries the step channel's host arrays and start-up
    agreements. Workers wait in it while the engine is idle, so its timeout is
    effectively unbounded (a dead driver is noticed by the worker's parent
    watch, not by a timeout).
Backends are used directly rather than through torch.distributed's default
group: no process-wide state, so one process can hold several engines.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import distributed as dist

HOST_TIMEOUT = timedelta(days=365)
DEVICE_TIMEOUT = timedelta(minutes=30)
STORE_TIMEOUT = timedelta(minutes=5)
LOOPBACK = "127.0.0.1"


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    device_group: Any
    host_group: Any
    # Set on the driver once it serves: tells the workers about each logits
    # computation (step_channel.py), so they join its gather.
    announce_logits: Callable[[torch.Tensor], None] | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples, and publishes each step."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (capturable in a CUDA graph)."""
        self.device_group.allreduce([tensor]).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's `tensor`, in place."""
        _broadcast(self.device_group, tensor)
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's equally shaped `tensor`, in rank order, on rank 0; None elsewhere."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if not self.is_driver:
            self.device_group.gather([], [tensor], opts).wait()
            return None
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.device_group.gather([out], [tensor], opts).wait()
        return out

    def host_broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's host `tensor` into every rank's, in place."""
        _broadcast(self.host_group, tensor)
        return tensor

    def host_min(self, value: int) -> int:
        """The smallest of every rank's `value` (start-up agreements)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.host_group.allreduce([t], opts).wait()
        return int(t.item())


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def make_store(rank: int, size: int, port: int = 0) -> dist.TCPStore:
    """Rank 0 listens on a free loopback port (`store.port`); the others connect to `port`."""
    if rank == 0:
        return dist.TCPStore(LOOPBACK, 0, size, is_master=True, wait_for_workers=False,
                             timeout=STORE_TIMEOUT)
    return dist.TCPStore(LOOPBACK, port, size, is_master=False, timeout=STORE_TIMEOUT)


def connect(store: dist.Store, rank: int, size: int, device: torch.device) -> TPGroup:
    """Join both communicators (every rank calls this with its own rank)."""
    host = _gloo(dist.PrefixStore("host", store), rank, size, HOST_TIMEOUT)
    device_store = dist.PrefixStore("device", store)
    if device.type == "cuda":
        group = _nccl(device_store, rank, size)
    else:
        group = _gloo(device_store, rank, size, DEVICE_TIMEOUT)
    return TPGroup(rank, size, device, group, host)


def _gloo(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    # Loopback: one host, and no dependence on the machine's hostname resolving.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: dist.Store, rank: int, size: int) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = DEVICE_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, size, opts)
