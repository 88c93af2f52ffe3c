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


def test_the_host_state_of_the_timed_steps_is_read_from_proc():
    """Steal time is the 8th number of /proc/stat's first line, out of the first eight's sum; the
    core is the 39th field of a thread's stat line, whose name may hold spaces and parentheses."""
    assert host_step_bench.cpu_times("cpu  100 5 20 800 10 0 3 12 7 0\n") == (950.0, 12.0)
    stat = "4242 (py (x) 3) R 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 " \
           "28 29 30 31 32 33 34 35 5 0 0"
    assert host_step_bench.last_core(stat) == 5
    before = {"ivcsw": 10.0, "cpu": 1000.0, "steal": 4.0, "core": 1.0}
    after = {"ivcsw": 16.0, "cpu": 1400.0, "steal": 24.0, "core": -1.0}
    state = host_step_bench.host_state(before, after, steps=3)
    assert state == {"ivcsw": 2.0, "steal_pct": 5.0, "core": -1, "mhz": -1.0}


def test_the_table_says_what_else_ran(capsys):
    host_step_bench.main(["--stub-forward", "--running", "4", "--steps", "2", "--warmup", "1",
                          "--prompt-len", "24", "--temperature", "0"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("host state"))
    assert "4: " in line and "involuntary context switches a step, machine steal" in line
