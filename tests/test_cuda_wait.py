"""The engine's GPU wait mode (kvserve/runner/cuda_wait.py): chosen by KVSERVE_CUDA_WAIT, a bad
value refused by name, nothing touched off CUDA or once CUDA has started."""
from __future__ import annotations

import logging

import pytest
import torch

from kvserve.runner import cuda_wait


def test_default_is_cudas_own(monkeypatch):
    """CUDA's default: an alternating repeat showed no host-time gain from spinning, which costs
    a busy core (docs/BENCHMARKS_HISTORY.md)."""
    monkeypatch.delenv("KVSERVE_CUDA_WAIT", raising=False)
    assert cuda_wait.wait_mode_from_env() == "auto"
    monkeypatch.setenv("KVSERVE_CUDA_WAIT", "spin")
    assert cuda_wait.wait_mode_from_env() == "spin"


def test_bad_mode_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KVSERVE_CUDA_WAIT", "busy")
    with pytest.raises(ValueError, match="KVSERVE_CUDA_WAIT must be one of .*'busy'"):
        cuda_wait.wait_mode_from_env()


def test_bad_mode_fails_the_engine_build(monkeypatch):
    from kvserve.config import EngineArgs
    from kvserve.engine.builder import build_engine_parts
    monkeypatch.setenv("KVSERVE_CUDA_WAIT", "busy")
    with pytest.raises(ValueError, match="KVSERVE_CUDA_WAIT"):
        build_engine_parts(EngineArgs(model="dummy:tiny-llama", device="cpu"))


@pytest.mark.parametrize("mode", ["spin", "auto"])
def test_cpu_and_auto_touch_nothing(mode, monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_wait, "_set_primary_context_flags", lambda *a: calls.append(a) or True)
    assert cuda_wait.set_cuda_wait(torch.device("cpu"), mode) is False
    assert cuda_wait.set_cuda_wait(torch.device("cuda", 0), "auto") is False
    assert calls == []


def test_started_context_keeps_its_mode(monkeypatch, caplog):
    """A context started with another mode keeps it (warned); one started with this mode, by
    an earlier engine in the process, counts as set (nothing logged)."""
    caplog.set_level(logging.INFO, logger="kvserve.runner.cuda_wait")
    calls = []
    monkeypatch.setattr(cuda_wait, "_set_primary_context_flags", lambda *a: calls.append(a) or True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda_wait, "_primary_context_wait_flags", lambda ordinal: 0)
    assert cuda_wait.set_cuda_wait(torch.device("cuda", 1), "spin") is False
    assert calls == [] and "its wait mode stays" in caplog.text
    caplog.clear()
    monkeypatch.setattr(cuda_wait, "_primary_context_wait_flags", lambda ordinal: 1)
    assert cuda_wait.set_cuda_wait(torch.device("cuda", 1), "spin") is True
    assert calls == [] and "its wait mode stays" not in caplog.text


def test_flag_goes_to_the_engine_device(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_wait, "_set_primary_context_flags", lambda *a: calls.append(a) or True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert cuda_wait.set_cuda_wait(torch.device("cuda", 1), "blocking") is True
    assert cuda_wait.set_cuda_wait(torch.device("cuda"), "spin") is True
    assert calls == [(1, 4), (0, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["spin", "blocking"])
def test_context_starts_with_the_mode(mode):
    """On a GPU, in a fresh process: the context torch then starts carries the mode."""
    import subprocess
    import sys
    code = ("import torch; from kvserve.runner import cuda_wait as w; "
            f"assert w.set_cuda_wait(torch.device('cuda', 0), {mode!r}); torch.zeros(1, device='cuda'); "
            "print(w._primary_context_wait_flags(0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) == cuda_wait.WAIT_FLAGS[mode]
