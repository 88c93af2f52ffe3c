"""benchmarks/host_step_bench.py runs end to end on CPU, with requests leaving
between steps (`--leave-per-step`) and greedy sampling: its table comes out,
and the leaves happened (the running set shrank by one a step)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_step_bench  # noqa: E402


def test_the_bench_runs_with_requests_leaving_every_step(capsys, monkeypatch):
    counts = []
    leave = host_step_bench.leave

    def counted(engine, count, rng):
        leave(engine, count, rng)
        counts.append(len(engine.scheduler.running))
    monkeypatch.setattr(host_step_bench, "leave", counted)
    host_step_bench.main(["--stub-forward", "--running", "6", "--steps", "3", "--warmup", "1",
                          "--prompt-len", "24", "--leave-per-step", "1", "--temperature", "0"])
    out = capsys.readouterr().out
    assert "host_total" in out and "\n           6 " in out
    assert counts == [5, 4, 3]
