"""The device's measured ceilings, for MFU and bandwidth fractions: a large
bf16 matmul and a large device-to-device copy, timed with CUDA events."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceLimits:
    matmul_flops: float     # bf16 FLOP/s on random 8192^3 operands
    copy_bytes_per_s: float  # bytes read + written per second


def _time_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure_device_limits(device: torch.device) -> DeviceLimits:
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = _time_ms(lambda: a @ b)
    del a, b
    src = torch.randn(1024**3 // 2, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return DeviceLimits(2 * n**3 / (mm_ms / 1e3), nbytes / (copy_ms / 1e3))
