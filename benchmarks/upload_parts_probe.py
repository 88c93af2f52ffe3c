"""Where a decode step's one upload (`StagingRing.upload`) spends its host time: the
target's host-step run (`host_step_bench.py`) with each line of the upload timed.

On the device hosts the upload reads ~200-290 us a step at 256 running (`--parts`),
against ~8 us for a 4 KB pinned upload in `cuda_api_probe.py` and ~5 us on a CPU-only
machine (no copy to queue). This prints each line's median a step: taking the slot
(its event's wait), filling the pinned buffer, queueing the copy, recording its event,
and the bytes copied. `--variant side-stream` puts the copy on its own stream, which
waits for the compute stream and which the compute stream then waits for.

    python3 benchmarks/upload_parts_probe.py --model dummy:qwen3-8b --device cuda --running 256 --steps 96 \
        [--variant side-stream]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import host_step_bench  # noqa: E402
from kvserve.runner import staging  # noqa: E402

SAMPLES: dict[str, list[int]] = {}
VARIANT = "as-is"   # --variant: as-is | side-stream (the copy on its own stream, the compute stream waits)
_SIDE = {}


def _copy(layout) -> None:
    if VARIANT == "as-is":
        layout.device_bytes.copy_(layout.host_bytes, non_blocking=True)
        return
    import torch
    main_stream = torch.cuda.current_stream()
    side = _SIDE.setdefault("stream", torch.cuda.Stream())
    side.wait_stream(main_stream)   # the device buffer's last readers are on the compute stream
    with torch.cuda.stream(side):
        layout.device_bytes.copy_(layout.host_bytes, non_blocking=True)
    main_stream.wait_stream(side)


def timed_upload(self, parts):
    """`StagingRing.upload`, each line timed into SAMPLES."""
    clock = time.perf_counter_ns
    t0 = clock()
    slot, layout = self.take(parts)
    t1 = clock()
    for view, part in zip(layout.host_views, parts):
        view[...] = part.numpy()
    t2 = clock()
    _copy(layout)
    t3 = clock()
    self.copied(slot)
    t4 = clock()
    for name, value in (("take", t1 - t0), ("fill", t2 - t1), ("copy_", t3 - t2), ("copied", t4 - t3),
                        ("bytes", layout.host_bytes.numel())):
        SAMPLES.setdefault(name, []).append(value)
    return layout.device_views


def main() -> None:
    global VARIANT
    argv = sys.argv[1:]
    if "--variant" in argv:
        i = argv.index("--variant")
        VARIANT = argv[i + 1]
        del argv[i:i + 2]
    staging.StagingRing.upload = timed_upload
    host_step_bench.main(argv)
    print(f"variant: {VARIANT}")
    print("upload lines, median a call (us; bytes: the copy's size), calls:", len(SAMPLES.get("take", [])))
    for name, values in SAMPLES.items():
        scale = 1 if name == "bytes" else 1e3
        p90 = sorted(values)[int(0.9 * len(values))]
        print(f"  {name:8s} {statistics.median(values) / scale:10.1f}   p90 {p90 / scale:10.1f}")


if __name__ == "__main__":
    main()
