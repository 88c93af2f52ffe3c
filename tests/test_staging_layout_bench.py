"""benchmarks/staging_layout_bench.py times this tree's staging ring or another
version of the module, and what it uploads arrives: its parts are decode-shaped
and the ring hands back views equal to them."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import staging_layout_bench as bench  # noqa: E402


def test_the_patterns_and_parts_are_what_the_bench_says():
    pats = bench.patterns()
    assert set(pats["steady"]) == {256} and min(pats["random walk 150-256"]) >= 150
    falling = pats["falling, none twice"]
    assert len(set(falling)) == len(falling) and falling[0] == 256
    parts = bench.decode_parts(7)
    assert len(parts) == 8 and parts[3].shape == (8,) and parts[6].shape == (7, 80)


def test_a_staging_file_is_timed_and_its_uploads_arrive(tmp_path):
    copy = tmp_path / "staging_copy.py"
    copy.write_text((ROOT / "kvserve" / "runner" / "staging.py").read_text())
    staging = bench.staging_module(str(copy))
    assert staging.__file__ == str(copy)
    assert bench.median_upload_us(staging, [9, 8, 9]) > 0
    ring = staging.StagingRing(torch.device("cpu"), pin_memory=False, event=bench.NoEvent)
    parts = [torch.arange(n, dtype=t.dtype).reshape(t.shape) for n, t in
             ((p.numel(), p) for p in bench.decode_parts(5))]
    assert all(map(torch.equal, ring.upload(parts), parts))
