"""benchmarks/host_step_bench.py runs end to end on CPU with greedy sampling,
with requests leaving between steps (`--leave-per-step`: the running set shrank
by one a step) or finishing inside them (`--finish-per-step`): its table comes
out, and the leaves and finishes happened."""
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


def test_the_bench_finishes_requests_inside_every_timed_step(capsys, monkeypatch):
    """`--finish-per-step 2`: two requests finish (length) in each of the three
    timed steps, found in the step's own output processing."""
    finished_per_step = []
    timed_step = host_step_bench.timed_step

    def counted(engine, core, timer):
        before = len(engine.scheduler.running)
        row = timed_step(engine, core, timer)
        finished_per_step.append(before - len(engine.scheduler.running))
        return row
    monkeypatch.setattr(host_step_bench, "timed_step", counted)
    host_step_bench.main(["--stub-forward", "--running", "8", "--steps", "3", "--warmup", "1",
                          "--prompt-len", "24", "--finish-per-step", "2", "--temperature", "0"])
    assert "host_total" in capsys.readouterr().out
    assert finished_per_step == [2, 2, 2]
