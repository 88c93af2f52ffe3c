"""Per-op host cost of one upload on CUDA (microseconds, median of 2000): the device call that ran it carried this file as scratch/upload_micro.py, run as `python3 scratch/upload_micro.py`."""
import time, statistics, torch, numpy as np
from kvserve.runner.staging import StagingRing, current_stream, _starts
dev = torch.device("cuda")
B, W = 256, 80
parts = [torch.zeros(B, dtype=torch.int64), torch.arange(B), torch.arange(B), torch.arange(B + 1, dtype=torch.int32),
         torch.ones(B, dtype=torch.int32), torch.arange(B), torch.zeros(B, W, dtype=torch.int32)]
ring = StagingRing(dev)
for _ in range(50): ring.upload(parts)
def t(label, fn, n=2000):
    xs = []
    for _ in range(n):
        s = time.perf_counter_ns(); fn(); xs.append(time.perf_counter_ns() - s)
    print(f"{label:40s} {statistics.median(xs)/1e3:8.2f} us")
t("ring.upload (whole)", lambda: ring.upload(parts))
slot, layout = ring.take(parts); ring.copied(slot)
t("key tuple", lambda: tuple([(x.dtype, x.shape) for x in parts]))
ev = torch.cuda.Event(); ev.record(); torch.cuda.synchronize()
t("event.synchronize (done)", ev.synchronize)
t("event.record(current_stream cached)", lambda: ev.record(current_stream(dev)))
t("event.record()", lambda: ev.record())
t("torch.cuda.current_stream()", torch.cuda.current_stream)
t("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
t("current_stream(dev) cached", lambda: current_stream(dev))
def fill():
    for v, p in zip(layout.host_views, parts): v[...] = p.numpy()
t("numpy fills", fill)
t("copy_ H2D non_blocking", lambda: layout.device_bytes.copy_(layout.host_bytes, non_blocking=True))
t("ring.take", lambda: ring.take(parts))
t("_starts", lambda: _starts(parts))
t("torch.arange(257, int32)", lambda: torch.arange(257, dtype=torch.int32))
t("torch.from_numpy", lambda: torch.from_numpy(np.zeros(4)))
t("tensor slice+view+view (cuda)", lambda: layout.device_bytes[0:1024].view(torch.int32).view(256))
t("old path: pin .to(dev) 1 part", lambda: parts[0].to(dev, non_blocking=True))
torch.cuda.synchronize()
