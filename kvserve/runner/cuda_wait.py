"""How the engine's thread waits for the GPU: the CUDA context's scheduling flag.

Every step the engine waits for the step in flight (the sampled ids' copy). One run each on an
H200's host, the default first, read 2,043 us of host work a step at 256 running under CUDA's
default ("auto"), 1,306 blocking and 990 spinning; the alternating repeat (auto, spin, spin,
auto: 1,139, 1,458, 879, 1,046 us) showed no effect of the mode, only run-to-run spread
(`benchmarks/host_step_bench.py --wait-mode`, 2026-12-04, docs/BENCHMARKS.md). So the engine
keeps CUDA's default, which costs no busy core; `KVSERVE_CUDA_WAIT=auto|spin|yield|blocking`
chooses another. The flag belongs to the device's primary context and must be set before that
context starts (`build_engine_parts` does it first); later, the context's flag stays and the log
says so.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

logger = logging.getLogger(__name__)

# CUDA's context scheduling flags (CU_CTX_SCHED_*)
WAIT_FLAGS = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}
DEFAULT_WAIT = "auto"


def wait_mode_from_env() -> str:
    mode = os.environ.get("KVSERVE_CUDA_WAIT", DEFAULT_WAIT)
    if mode not in WAIT_FLAGS:
        raise ValueError(f"KVSERVE_CUDA_WAIT must be one of {sorted(WAIT_FLAGS)}, got {mode!r}")
    return mode


def set_cuda_wait(device: torch.device, mode: str | None = None) -> bool:
    """Set the wait mode (default: `wait_mode_from_env`) on `device`'s primary context;
    False where it was left as it was (not CUDA, "auto", the driver refused, or the context
    had started with another mode; one started with this mode counts as set)."""
    mode = mode or wait_mode_from_env()
    if device.type != "cuda" or mode == "auto":
        return False
    ordinal, flags = device.index or 0, WAIT_FLAGS[mode]
    if torch.cuda.is_initialized():
        if _primary_context_wait_flags(ordinal) == flags:
            return True   # an earlier engine in this process set it
        # info, not a warning: a process that used CUDA first (a test, a notebook) loses only speed
        logger.info("CUDA was initialised before the engine: its wait mode stays (KVSERVE_CUDA_WAIT=%s not applied)",
                    mode)
        return False
    return _set_primary_context_flags(ordinal, flags)


def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        logger.warning("CUDA driver not loadable (%s): the GPU wait mode stays CUDA's default", e)
        return None


def _primary_context_wait_flags(ordinal: int) -> int | None:
    """The scheduling bits of the device's primary context's flags; None where unreadable."""
    driver = _driver()
    handle, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if driver is None or driver.cuDeviceGet(ctypes.byref(handle), ordinal) or driver.cuDevicePrimaryCtxGetState(
            handle, ctypes.byref(flags), ctypes.byref(active)):
        return None
    return flags.value & 7   # CU_CTX_SCHED_MASK


def _set_primary_context_flags(ordinal: int, flags: int) -> bool:
    driver = _driver()
    if driver is None:
        return False
    set_flags = getattr(driver, "cuDevicePrimaryCtxSetFlags_v2", None) or driver.cuDevicePrimaryCtxSetFlags
    handle = ctypes.c_int()
    for rc in (driver.cuInit(0), driver.cuDeviceGet(ctypes.byref(handle), ordinal), set_flags(handle, flags)):
        if rc:
            logger.warning("CUDA driver error %d setting the GPU wait mode: it stays CUDA's default", rc)
            return False
    return True
