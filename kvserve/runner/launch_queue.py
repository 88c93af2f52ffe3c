"""The device's launch queue: how far the host may run ahead of the device.

CUDA queues about a thousand launches per context by default. An eager step
of a 36-layer model is ~600 kernels, so a long step launched while the step
before it still runs fills the queue, and the host blocks inside its launches
until the device has run most of that earlier step: the step's host time
becomes the device's, and the tokens the engine reads after the launch go out
a whole step late (the served mixed burst's 220-250 ms host stalls).

The driver sizes the queue from CUDA_SCALE_LAUNCH_QUEUES when it starts, so
the engine asks for 4x (the largest scale the driver takes) before anything
touches CUDA. A value the user set is kept; once CUDA has started, nothing
changes and the call says so.
"""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

LAUNCH_QUEUE_ENV = "CUDA_SCALE_LAUNCH_QUEUES"
LAUNCH_QUEUE_SCALE = "4x"


def widen_launch_queue() -> str | None:
    """Ask the driver for a 4x launch queue unless the user chose a scale or CUDA
    already started. Returns the scale in effect when known (None: the driver's
    default, fixed by an earlier start)."""
    chosen = os.environ.get(LAUNCH_QUEUE_ENV)
    if chosen is not None:
        return chosen
    if torch.cuda.is_initialized():
        logger.debug("CUDA started before the engine: its launch queue keeps the driver's default size")
        return None
    os.environ[LAUNCH_QUEUE_ENV] = LAUNCH_QUEUE_SCALE
    return LAUNCH_QUEUE_SCALE
