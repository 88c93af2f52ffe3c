"""`kvserve bench sweep` on CPU with tiny shapes: table, CSV, JSON and PNG;
the recommendation rule; the KV cap reaches the engine."""
from __future__ import annotations

import csv
import json

import pytest

from kvserve.bench.sweep import COLUMNS, SweepRow, parse_int_list, recommend, word_token_ids
from kvserve.cli import main

pytest.importorskip("matplotlib")


def test_sweep_writes_table_csv_json_png(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--model", "dummy:tiny-llama", "--load-format", "dummy", "--device", "cpu",
                 "--dtype", "float32", "--max-model-len", "256", "--workload", "ide-completion",
                 "--num-prompts", "10", "--scale", "0.05", "--block-sizes", "8,16",
                 "--max-num-batched-tokens", "32,256", "--kv-tokens", "1024", "--output", str(out),
                 "--save-records", str(tmp_path / "records")]) == 0
    text = capsys.readouterr().out
    assert "hit rate" in text and "recommended: block size" in text
    with open(f"{out}.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["block_size"]), int(r["budget"])) for r in rows] == [(8, 32), (8, 256), (16, 32), (16, 256)]
    assert set(rows[0]) == set(COLUMNS)
    # IDE requests share file prefixes: every setting hits the cache.
    assert all(0 < float(r["hit_rate"]) < 1 and float(r["req_per_s"]) > 0 for r in rows)
    data = json.loads(open(f"{out}.json").read())
    picked = data["recommended"]
    assert (picked["block_size"], picked["budget"]) in [(r["block_size"], r["budget"]) for r in data["rows"]]
    assert open(f"{out}.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "records" / "record_bs16_budget32.json").read_text())
    # --kv-tokens 1024 at block 16: 64 blocks + the null block.
    assert record["config"]["num_blocks"] == 65 and record["config"]["max_num_batched_tokens"] == 32
    assert main(["diagnose", "--offline", str(tmp_path / "records" / "record_bs16_budget32.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"]


def _row(block: int, budget: int, rate: float, p95: float) -> SweepRow:
    return SweepRow(block, budget, 0.5, rate, p95 / 2, p95, 10.0, 1.0, 0.5, 0.1, 0.0, 0)


def test_recommend_prefers_rate_then_ttft():
    rows = [_row(8, 2048, 10.0, 300.0), _row(16, 2048, 9.8, 200.0), _row(32, 2048, 6.0, 100.0)]
    pick, why = recommend(rows)
    assert (pick.block_size, pick.budget) == (16, 2048)  # within 5% of the best rate, lower TTFT p95
    assert "block size 16, budget 2048" in why and "lowest TTFT p95" in why
    pick, _ = recommend([_row(8, 2048, 10.0, 300.0), _row(32, 2048, 6.0, 100.0)])
    assert pick.block_size == 8


def test_inputs_are_checked_and_words_map_to_stable_ids():
    with pytest.raises(ValueError, match="--block-sizes"):
        parse_int_list("8,x", "--block-sizes")
    with pytest.raises(ValueError, match=">= 1"):
        parse_int_list("0,16", "--block-sizes")
    ids = word_token_ids("the cache the block", 256)
    assert ids[0] == ids[2] and ids[0] != ids[1] and all(3 <= i < 256 for i in ids)


def test_profile_runs_on_cpu_and_writes_a_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["profile", "--model", "dummy:tiny-llama", "--load-format", "dummy", "--device", "cpu",
                 "--dtype", "float32", "--max-model-len", "64", "--num-prompts", "2", "--input-len", "16",
                 "--output-len", "4", "--trace", str(trace), "--top", "5"]) == 0
    text = capsys.readouterr().out
    assert "launches per step" in text and "aten::" in text
    assert "decode attention (range kvserve::decode_attention)" in text and "achieved" in text
    # 16-token prompts, 4 outputs: decode steps at contexts 17, 18, 19 (the prefill samples the first).
    assert "over 3 decode-only steps" in text
    assert json.loads(trace.read_text())["traceEvents"]


def test_decode_bytes_match_a_brute_force_count():
    from types import SimpleNamespace

    from kvserve.bench.profile import DecodeBytes
    from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
    specs = (SlidingWindowSpec(window=8), FullAttentionSpec(), SlidingWindowSpec(window=4, sink=2))
    tally = DecodeBytes(specs, bytes_per_token=10)
    step = lambda *rows: SimpleNamespace(is_empty=False, scheduled=[  # noqa: E731
        SimpleNamespace(num_new_tokens=n, start_pos=p) for n, p in rows])
    on_gpu = DecodeBytes(specs, bytes_per_token=10, mixed_rows=True)
    for t in (tally, on_gpu):
        t.observe(step((1, 19), (1, 5)))      # contexts 20 and 6
        t.observe(step((1, 30), (7, 0)))      # a mixed step: its one-query row (context 31) on a GPU only
    # Brute force: a query at position p sees key k when k <= p and (p - k < window or k < sink).
    def visible(spec, n):
        p = n - 1
        window, sink = getattr(spec, "window", n), getattr(spec, "sink", 0)
        return sum(1 for k in range(n) if p - k < window or k < sink)
    assert tally.bytes == 10 * sum(visible(s, n) for s in specs for n in (20, 6)) and tally.steps == 1
    assert on_gpu.bytes == 10 * sum(visible(s, n) for s in specs for n in (20, 6, 31)) and on_gpu.steps == 2


@pytest.mark.gpu
def test_profile_on_gpu_times_the_decode_kernel(tmp_path, capsys):
    """Device kernels, the Triton decode kernel matched by name, GB/s against the measured limit."""
    assert main(["profile", "--model", "dummy:tiny-llama", "--load-format", "dummy", "--max-model-len", "256",
                 "--num-prompts", "8", "--input-len", "64", "--output-len", "16", "--enforce-eager",
                 "--trace", str(tmp_path / "trace.json")]) == 0
    text = capsys.readouterr().out
    assert "device kernels" in text and "decode attention (kernels)" in text
    assert "of the measured copy limit" in text
    # CPU ops and the range also carry their kernels' device time: listing them counts kernels twice.
    assert "aten::" not in text and "kvserve::" not in text


def test_device_idle_counts_gaps_between_kernels_once():
    """Idle time is the gaps between the union of kernel spans (an overlapping
    kernel hides no gap), bucketed by length and charged to the kernels around it."""
    from types import SimpleNamespace
    from torch.autograd import DeviceType
    from kvserve.bench.profile import device_idle

    def kernel(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, key=name, device_type=device,
                               time_range=SimpleNamespace(start=start, end=end))
    events = [kernel("a", 0, 10), kernel("b", 11, 20), kernel("c", 15, 30),   # b and c overlap: no gap
              kernel("d", 130, 140), kernel("host op", 30, 130, DeviceType.CPU),  # a CPU op is not device time
              kernel("a", 143, 150)]
    lines = device_idle(SimpleNamespace(events=lambda: events), num_steps=1)
    assert lines[0] == "device idle 0.104 ms/step of 0.150 (3 gaps a step)"
    assert lines[1:6] == ["  gaps 0-2 us:    1.0 a step, 0.001 ms/step", "  gaps 2-5 us:    1.0 a step, 0.003 ms/step",
                          "  gaps 5-20 us:    0.0 a step, 0.000 ms/step", "  gaps 20-100 us:    0.0 a step, 0.000 ms/step",
                          "  gaps 100-inf us:    1.0 a step, 0.100 ms/step"]
    assert lines[6] == "  0.100 ms/step  c -> d"
