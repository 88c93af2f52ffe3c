"""Host microseconds of a decode step's upload calls while the device is busy, as in a
served step (the previous step's forward still runs), against an idle device.

`upload_parts_probe.py` read ~110 us for the step's one pinned copy (89 KB) and ~40 us
for the slot's event wait on an H100 host, where `cuda_api_probe.py` reads ~8 us for a
small upload to an idle device. This times, per call (median of many, each timed alone):
a pinned copy of 4 KB and 89 KB on the busy compute stream, the same on a side copy
stream with its event and the compute stream's wait on it, event record / query /
synchronize of a completed event, each with the compute stream idle and busy
(`torch.cuda._sleep` keeps it busy for longer than the timing takes).

    python3 benchmarks/busy_upload_probe.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_api_probe import per_call_us  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    done = torch.cuda.Event()
    done.record()
    torch.cuda.synchronize()
    cycles_per_ms = 1.9e6
    cases = {}
    for size in (4096, 89088):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(size, dtype=torch.uint8, device=dev)
        ev = torch.cuda.Event()

        def on_main(host=host, dst=dst):
            dst.copy_(host, non_blocking=True)

        def on_side(host=host, dst=dst, ev=ev):
            with torch.cuda.stream(side):
                dst.copy_(host, non_blocking=True)
                ev.record(side)
            main_stream.wait_event(ev)

        cases[f"copy {size} B, compute stream"] = on_main
        cases[f"copy {size} B, side stream + event + wait"] = on_side
    cases["event.record()"] = lambda: torch.cuda.Event().record()
    cases["completed event.query()"] = done.query
    cases["completed event.synchronize()"] = done.synchronize
    print(f"device: {torch.cuda.get_device_name()}; median us a call, 200 calls")
    print("| call | idle | busy |\n|---|---|---|")
    for name, fn in cases.items():
        torch.cuda.synchronize()
        idle = per_call_us(fn, 200)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(cycles_per_ms * 400))   # ~400 ms of device work queued first
        busy = per_call_us(fn, 200)
        torch.cuda.synchronize()
        print(f"| {name} | {idle:.1f} | {busy:.1f} |", flush=True)


if __name__ == "__main__":
    main()
