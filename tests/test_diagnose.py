"""`kvserve diagnose` on seeded CPU loads (tiny dummy Llama): each
misconfiguration's code is the top finding, a well-sized run is `healthy`;
request timelines; offline records through the CLI; the rules on their own."""
from __future__ import annotations

import json
import random

import pytest

from kvserve.cli import main
from kvserve.diagnose.drive import DriveRequest, run_recorded
from kvserve.diagnose.report import analyze
from kvserve.diagnose.rules import diagnose
from kvserve.diagnose.window import Window
from kvserve.entrypoints.llm import LLM

MODEL = "dummy:tiny-llama"


def _llm(**kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    return LLM(MODEL, load_format="dummy", device="cpu", dtype="float32", block_size=8, **kwargs)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def _independent(num: int, prompt_len: int, max_tokens: int, seed: int = 0) -> list[DriveRequest]:
    rng = random.Random(seed)
    return [DriveRequest(_tokens(rng, prompt_len), max_tokens) for _ in range(num)]


def _multi_turn(num_conversations: int, turns: int, seed: int = 0) -> list[DriveRequest]:
    """Turn t of every conversation, then turn t+1: each turn re-sends the
    history plus a new question, after the previous turn finished."""
    rng = random.Random(seed)
    history = [_tokens(rng, 64) for _ in range(num_conversations)]
    out: list[DriveRequest] = []
    for t in range(turns):
        for c in range(num_conversations):
            history[c] = history[c] + _tokens(rng, 24)
            after = len(out) - num_conversations if t else None
            out.append(DriveRequest(list(history[c]), 8, after))
    return out


def _top(llm: LLM, requests, **kwargs) -> tuple[str, dict]:
    # A sample after every step: with a wall-clock period the number of samples,
    # and so the trends the rules read, depended on how busy the machine was.
    kwargs.setdefault("sample_period_s", 0.0)
    result = analyze(_window(run_recorded(llm, requests, **kwargs).record))
    return result["findings"][0]["code"], result


def _window(record) -> Window:
    return Window(record.samples, record.config, record.requests)


def test_kv_pool_too_small_for_concurrency():
    llm = _llm(num_kv_blocks=30, max_model_len=128, max_num_batched_tokens=512)
    code, result = _top(llm, _independent(10, 40, 32))
    assert code == "kv_cache_capacity", result["findings"]
    finding = result["findings"][0]
    assert finding["evidence"]["preemptions"] >= 2 and "--num-kv-blocks" in finding["fix"]


def test_token_budget_far_below_prompts():
    llm = _llm(num_kv_blocks=300, max_num_batched_tokens=16, max_num_seqs=6)
    code, result = _top(llm, _independent(6, 160, 4))
    assert code == "token_budget_too_small", result["findings"]
    # The recommendation uses the measured lengths: (160 + 4) x concurrency x 1.5 >= one prompt.
    budget = int(result["findings"][0]["fix"].split()[1])
    assert budget >= 160 and budget % 8 == 0


def test_prefix_caching_off_on_multi_turn():
    llm = _llm(num_kv_blocks=300, enable_prefix_caching=False)
    code, result = _top(llm, _multi_turn(4, 3))
    assert code == "prefix_caching_disabled", result["findings"]
    assert result["evidence"]["reusable_fraction"] > 0.4 and result["evidence"]["hit_rate"] == 0


def test_multi_turn_under_kv_cap_loses_reuse():
    llm = _llm(num_kv_blocks=48, max_num_seqs=2)
    code, result = _top(llm, _multi_turn(8, 3))
    assert code == "prefix_cache_thrash", result["findings"]
    ev = result["evidence"]
    assert ev["evictions"] > 0 and ev["preemptions"] == 0 and ev["hit_rate"] < 0.7 * ev["reusable_fraction"]


def test_well_sized_multi_turn_is_healthy():
    llm = _llm(num_kv_blocks=400, max_num_seqs=2)
    code, result = _top(llm, _multi_turn(8, 3))
    assert code == "healthy", result["findings"]
    ev = result["evidence"]
    # Every reusable token was hit (hits count the same first-admission lookups).
    assert ev["hit_rate"] == pytest.approx(ev["reusable_fraction"], abs=0.02)


def test_queue_growing_at_steady_arrivals_is_overload():
    llm = _llm(num_kv_blocks=300, max_num_seqs=2)
    code, result = _top(llm, _independent(12, 16, 16, seed=3), requests_per_step=0.5)
    assert code == "engine_overloaded", result["findings"]


def test_timeline_records_chunks_preemption_and_hits():
    llm = _llm(num_kv_blocks=40, max_model_len=128, max_num_batched_tokens=16)
    out = run_recorded(llm, _independent(6, 40, 40)).outputs
    events = [[e["event"] for e in o.metrics.timeline] for o in out]
    assert all(ev[0] == "arrival" and ev[1] == "scheduled" and ev[-1] == "finish" for ev in events)
    # 40 prompt tokens under a 16-token budget: at least 3 prefill chunks summing to the prompt.
    first = out[0].metrics.timeline
    chunks = [e["tokens"] for e in first[:[e["event"] for e in first].index("first_token")] if e["event"] == "prefill"]
    assert len(chunks) >= 3 and sum(chunks) == 40
    preempted = [o for o in out if o.metrics.num_preemptions]
    assert preempted and all("resumed" in [e["event"] for e in o.metrics.timeline] for o in preempted)
    times = [e["t"] for e in first]
    assert times == sorted(times)


def test_offline_record_through_cli(tmp_path, capsys):
    llm = _llm(num_kv_blocks=300, enable_prefix_caching=False)
    path = tmp_path / "record.json"
    run_recorded(llm, _multi_turn(3, 2)).record.save(str(path))
    assert main(["diagnose", "--offline", str(path), "--json"]) == 0
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert findings[0]["code"] == "prefix_caching_disabled"
    assert set(findings[0]) == {"code", "severity", "evidence", "fix"}
    assert main(["diagnose", "--offline", str(path)]) == 0
    text = capsys.readouterr().out
    assert "prefix_caching_disabled" in text and "--enable-prefix-caching" in text and "slowest requests" in text


def _evidence(**overrides) -> dict:
    ev = dict(window_s=10.0, requests_arrived=100, requests_finished=100, arrivals_per_s=10.0,
              finished_per_s=10.0, mean_prompt_tokens=900.0, mean_output_tokens=100.0, hit_rate=0.5,
              reusable_fraction=0.5, reusable_fraction_by_block_size={8: 0.5, 16: 0.5, 32: 0.5},
              evictions=0.0, evictions_per_s=0.0, preemptions=0.0, preemptions_per_s=0.0, kv_usage_mean=0.5,
              kv_usage_max=0.6, kv_usage_full_share=0.0, fragmentation_mean=0.05, waiting_mean=0.0,
              waiting_first=0.0, waiting_last=0.0, waiting_slope_per_s=0.0, arrival_window_s=10.0,
              arrival_period_arrivals_per_s=10.0, arrival_period_finished_per_s=10.0, running_mean=8.0,
              running_max=16.0, requests_with_timeline=0, arrival_samples=10,
              largest_burst_share=0.1)
    ev.update(overrides)
    return ev


CONFIG = dict(block_size=32, num_blocks=1000, bytes_per_block=1 << 20, enable_prefix_caching=True,
              max_num_batched_tokens=8192, max_num_seqs=64, max_model_len=8192)


def test_rules_block_size_granularity_and_fragmentation():
    assert diagnose(_evidence(), CONFIG)[0].code == "healthy"
    coarse = _evidence(reusable_fraction=0.3, reusable_fraction_by_block_size={8: 0.6, 16: 0.5, 32: 0.3})
    top = diagnose(coarse, CONFIG)[0]
    assert top.code == "block_size_mismatch" and "--block-size 8" in top.fix
    top = diagnose(_evidence(fragmentation_mean=0.45), CONFIG)[0]
    assert top.code == "block_size_mismatch" and "--block-size 16" in top.fix


def test_rules_rank_by_severity_and_json_shape():
    ev = _evidence(preemptions=80.0, kv_usage_max=1.0, hit_rate=0.1, reusable_fraction=0.6, evictions=500.0)
    findings = diagnose(ev, CONFIG)
    assert [f.code for f in findings][:2] == ["kv_cache_capacity", "prefix_cache_thrash"]
    assert "healthy" not in [f.code for f in findings]
    assert set(findings[0].as_dict()) == {"code", "severity", "evidence", "fix"}


def test_rules_overload_from_a_small_budget_ranks_after_the_budget():
    """A growing queue explained by prompt chunking: the budget fix comes
    first, and the overload names it instead of asking for replicas first."""
    overloaded = dict(arrival_period_finished_per_s=3.0, waiting_first=0.0, waiting_last=40.0,
                      waiting_slope_per_s=4.0)
    assert diagnose(_evidence(**overloaded), CONFIG)[0].code == "engine_overloaded"
    chunked = dict(prefill_chunks_mean=8.0, prompts_chunked_share=1.0, requests_with_timeline=100,
                   ttft_mean_ms=900.0, ttft_queue_ms=600.0, ttft_prefill_ms=250.0, ttft_first_decode_ms=50.0)
    findings = diagnose(_evidence(**overloaded, **chunked), {**CONFIG, "max_num_batched_tokens": 128})
    assert [f.code for f in findings] == ["token_budget_too_small", "engine_overloaded"]
    assert findings[1].severity == "warning" and findings[1].fix.startswith("apply the token_budget_too_small fix")


def test_debug_endpoint_serves_config_and_full_metrics():
    from fastapi.testclient import TestClient

    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.server.app import build_app
    engine = LLMEngine(EngineArgs(model=MODEL, load_format="dummy", device="cpu", dtype="float32",
                                  block_size=8, max_model_len=256, num_kv_blocks=100))
    with TestClient(build_app(engine, "tiny")) as client:
        body = client.get("/debug/kvserve").json()
    assert body["config"]["block_size"] == 8 and body["config"]["num_blocks"] == 100
    assert isinstance(body["requests"], list) and isinstance(body["metrics"], dict)


def test_recorder_reuse_matches_longest_common_prefix():
    """Reusable tokens at block size B: the longest prefix shared with any earlier
    prompt, in whole blocks, at most prompt - 1 tokens (brute force over pairs)."""
    from types import SimpleNamespace

    from kvserve.diagnose.recorder import RequestRecorder
    rng = random.Random(5)
    base = _tokens(rng, 150)
    prompts = [base[:n] + _tokens(rng, m) for n, m in ((0, 120), (37, 40), (100, 3), (150, 0), (64, 64), (5, 90))]
    recorder = RequestRecorder(block_size=16)
    for p in prompts:
        recorder.on_arrival(SimpleNamespace(prompt_token_ids=p, cache_salt=None))

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    for b in (8, 16, 32, 64):
        expect = 0
        for i, p in enumerate(prompts):
            shared = max((common(p, q) for q in prompts[:i]), default=0)
            expect += min(shared // b * b, (len(p) - 1) // b * b)
        assert recorder.reusable_tokens[b] == expect, b
    assert recorder.as_dict()["prefix_reusable_tokens"] == recorder.reusable_tokens[16] > 0
    # a salted prompt reuses nothing of the unsalted ones (the cache keeps them apart), then its own salt's
    before = recorder.reusable_tokens[16]
    recorder.on_arrival(SimpleNamespace(prompt_token_ids=base, cache_salt="tenant"))
    assert recorder.reusable_tokens[16] == before
    recorder.on_arrival(SimpleNamespace(prompt_token_ids=base + [1], cache_salt="tenant"))
    assert recorder.reusable_tokens[16] == before + 144
