"""The engine asks the driver for a 4x launch queue before CUDA starts (`widen_launch_queue`):
a user's own scale is kept, and once CUDA has started nothing changes."""
from __future__ import annotations

import os

import torch

from kvserve.runner import launch_queue
from kvserve.runner.launch_queue import LAUNCH_QUEUE_ENV, widen_launch_queue


def _unset(monkeypatch) -> None:
    """Unset for the test, and unset again after it (delenv alone records nothing to undo
    when the variable was absent, and the value the engine sets would outlive the test)."""
    monkeypatch.setenv(LAUNCH_QUEUE_ENV, "")
    monkeypatch.delenv(LAUNCH_QUEUE_ENV)


def test_unset_scale_becomes_4x_before_cuda_starts(monkeypatch):
    _unset(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert widen_launch_queue() == "4x"
    assert os.environ[LAUNCH_QUEUE_ENV] == "4x"


def test_a_scale_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(LAUNCH_QUEUE_ENV, "2x")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert widen_launch_queue() == "2x"
    assert os.environ[LAUNCH_QUEUE_ENV] == "2x"


def test_nothing_changes_once_cuda_has_started(monkeypatch):
    _unset(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert widen_launch_queue() is None
    assert LAUNCH_QUEUE_ENV not in os.environ
    assert launch_queue.LAUNCH_QUEUE_SCALE == "4x"
