"""A staging-ring layout built from nothing (every view new), from cached views, and a whole upload: us, median of 3000, CPU tensors standing in for the device buffer."""
import time, statistics, torch
from kvserve.runner.staging import StagingRing
class Ev:
    def record(self, s=None): pass
    def synchronize(self): pass
B = 256
parts = [torch.zeros(B, dtype=torch.int64), torch.arange(B), torch.arange(B), torch.arange(B + 1, dtype=torch.int32),
         torch.ones(B, dtype=torch.int32), torch.arange(B), torch.zeros(B, 80, dtype=torch.int32)]
ring = StagingRing(torch.device("cpu"), pin_memory=False, event=Ev)
ring.upload(parts)
key = tuple((t.dtype, t.shape) for t in parts)
xs = []
for _ in range(3000):
    ring._views[0].clear()
    s = time.perf_counter_ns(); ring._lay_out(0, key, parts); xs.append(time.perf_counter_ns() - s)
print("miss (all views new)", statistics.median(xs) / 1e3, "us")
xs = []
for _ in range(3000):
    s = time.perf_counter_ns(); ring._lay_out(0, key, parts); xs.append(time.perf_counter_ns() - s)
print("layout from cached views", statistics.median(xs) / 1e3, "us")
xs = []
for _ in range(3000):
    s = time.perf_counter_ns(); ring.upload(parts); xs.append(time.perf_counter_ns() - s)
print("upload, layout hit", statistics.median(xs) / 1e3, "us")
