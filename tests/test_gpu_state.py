"""benchmarks/gpu_state.py: the GPU's state over a timed window, read from a sampler process's log
(here a stand-in for nvidia-smi that prints known lines), and offline_scenarios' table of it."""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_state = _load("gpu_state")

# Prints two samples, waits for the file "go" to exist, then prints two more and a line cut short.
SAMPLER = """
import os, sys, time
print("1980, 3201, 50, 400.5"); print("1900, 3201, 52, 500.5", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
print("[N/A], 3201, 60, 600"); print("1500, 3201, 61, 700.0"); print("1700, 3201, 63, 680.0")
sys.stdout.write("1600, 32"); sys.stdout.flush()
time.sleep(60)
"""


def _samples(log, since, count):
    deadline = time.monotonic() + 10
    while log.summary(since).get("samples", 0) < count:
        assert time.monotonic() < deadline, "the sampler's lines never came"
        time.sleep(0.02)
    return log.summary(since)


def test_a_window_averages_only_the_samples_written_in_it(tmp_path):
    go = tmp_path / "go"
    log = gpu_state.GpuStateLog.start(command=[sys.executable, "-c", SAMPLER, str(go)])
    try:
        first = _samples(log, 0, 2)
        assert first == {"samples": 2, "sm_mhz": 1940.0, "sm_mhz_min": 1900.0, "mem_mhz": 3201.0,
                         "power_w": 450.5, "temp_c_max": 52.0}
        mark = log.mark()
        go.touch()
        time.sleep(0.3)   # the cut-off line is written by now, and must not count
        second = _samples(log, mark, 2)
        assert second == {"samples": 2, "sm_mhz": 1600.0, "sm_mhz_min": 1500.0, "mem_mhz": 3201.0,
                          "power_w": 690.0, "temp_c_max": 63.0}
        assert _samples(log, 0, 4)["samples"] == 4
    finally:
        log.stop()
    assert not log.on and log.summary(0) == {}


def test_a_mark_inside_a_line_leaves_that_line_to_the_window_before(tmp_path):
    """A window marked while the sampler was halfway through a line must not read that line's
    tail as a sample: cut inside its first number ("19" | "80, 3201, 50, 400.5"), the tail
    would parse as four numbers."""
    log = gpu_state.GpuStateLog(None, None)
    path = tmp_path / "log.csv"
    path.write_text("1900, 3201, 52, 500.5\n1980, 3201, 50, 400.5\n1700, 3201, 63, 680.0\n")
    log._proc, log._path = object(), str(path)   # a log whose sampler has finished
    middle = len("1900, 3201, 52, 500.5\n19")
    assert log.summary(middle)["samples"] == 1 and log.summary(middle)["sm_mhz"] == 1700.0
    at_start = len("1900, 3201, 52, 500.5\n")
    assert log.summary(at_start)["samples"] == 2 and log.summary(0)["samples"] == 3


def test_without_nvidia_smi_the_log_is_off(monkeypatch):
    monkeypatch.setattr(gpu_state.shutil, "which", lambda name: None)
    log = gpu_state.GpuStateLog.start()
    assert not log.on and log.mark() == 0 and log.summary(0) == {}
    log.stop()


def test_the_comparison_shows_both_runs_clocks(tmp_path, capsys):
    pytest.importorskip("kvserve.bench.workloads")
    offline = _load("offline_scenarios")
    gpu = {"samples": 9, "sm_mhz": 1755.4, "sm_mhz_min": 1600, "mem_mhz": 3201, "power_w": 612.2, "temp_c_max": 71}
    run = {"requests": 4, "prompt_tokens": 40, "output_tokens": 8, "seconds": 2.0}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(offline.json.dumps({"engine": "kvserve", "scenarios": {"qa": {**run, "gpu": gpu}}}))
    b.write_text(offline.json.dumps({"engine": "vllm", "scenarios": {"qa": {**run, "seconds": 2.5}}}))
    offline.compare([str(a), str(b)])
    row = capsys.readouterr().out.splitlines()[-1]
    assert row == "| qa | 4 | 2.00 | 2.50 | 0.800x | 1755 / - | 612 / - | 71 / - | - / - |"
    assert offline.gpu_text(gpu) == "  SM 1755 MHz (min 1600) 612 W max 71 C" and offline.gpu_text({}) == ""
    held = {**gpu, "power_capped_pct": 37.5, "thermal_pct": 0.0, "hw_slowdown_pct": 12.5}
    b.write_text(offline.json.dumps({"engine": "vllm", "scenarios": {"qa": {**run, "gpu": held}}}))
    offline.compare([str(a), str(b)])
    assert capsys.readouterr().out.splitlines()[-1].endswith("| 71 / 71 | - / 38 |")
    assert offline.gpu_text(held).endswith("612 W max 71 C, held back: power 38% heat 0% hw 12%")


# Samples with the clocks' reasons: idle; power cap; power cap and HW slowdown; SW thermal; power brake.
REASONED = """
print("1980, 3201, 50, 100.0, 0x0000000000000001")
print("1800, 3201, 60, 700.0, 0x0000000000000004")
print("1700, 3201, 61, 690.0, 0x000000000000000C")
print("1750, 3201, 80, 600.0, 0x0000000000000020")
print("1650, 3201, 62, 700.0, 0x0000000000000080", flush=True)
import time; time.sleep(60)
"""


def test_a_window_counts_the_samples_each_limit_held_back(tmp_path):
    log = gpu_state.GpuStateLog.start(command=[sys.executable, "-c", REASONED])
    try:
        state = _samples(log, 0, 5)
    finally:
        log.stop()
    assert state["power_capped_pct"] == 60.0   # bits 0x4 and 0x80 (not the idle bit 0x1)
    assert state["thermal_pct"] == 20.0 and state["hw_slowdown_pct"] == 20.0
    assert state["sm_mhz"] == 1776.0 and state["power_w"] == 558.0 and state["temp_c_max"] == 80.0


def test_the_reason_field_is_probed_newest_name_first(monkeypatch):
    asked = []

    def run(command, **_):
        field = command[1].split("=", 1)[1]
        asked.append(field)
        known = field == "clocks_throttle_reasons.active"   # an older driver
        return gpu_state.subprocess.CompletedProcess(command, 0 if known else 2, "0x0000000000000000\n" if known
                                                     else 'Field "clocks_event_reasons.active" is not valid.\n', "")

    monkeypatch.setattr(gpu_state.subprocess, "run", run)
    assert gpu_state.reason_field() == "clocks_throttle_reasons.active"
    assert asked == ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]
    monkeypatch.setattr(gpu_state.subprocess, "run", lambda command, **_: gpu_state.subprocess.CompletedProcess(
        command, 2, "", "not valid"))
    assert gpu_state.reason_field() is None
