"""Synthetic serving workloads and the bench's pure helpers (no server needed)."""
from __future__ import annotations

import statistics

import pytest

from kvserve.bench.serve import RequestResult, parse_goodput, parse_prometheus, summarize
from kvserve.bench.workloads import NUM_IDE_FILES, SHAPES, WORKLOADS, generate_workload


@pytest.mark.parametrize("workload", WORKLOADS)
def test_seeded_and_sized(workload):
    a = generate_workload(workload, 40, seed=3, scale=0.1)
    assert a == generate_workload(workload, 40, seed=3, scale=0.1)
    assert a != generate_workload(workload, 40, seed=4, scale=0.1)
    assert len(a) == 40 and all(r.prompt and r.max_tokens >= 1 for r in a)
    assert all(r.after is None or r.after < i for i, r in enumerate(a))


@pytest.mark.parametrize("scenario", ["qa", "long-doc", "ide-completion"])
def test_lengths_are_heavy_tailed_around_the_spec_means(scenario):
    requests = generate_workload(scenario, 400, seed=0, scale=0.25)
    mean_in, mean_out, _ = SHAPES[scenario]
    outs = [r.max_tokens for r in requests]
    assert 0.7 * mean_out * 0.25 < statistics.mean(outs) < 1.3 * mean_out * 0.25
    assert statistics.mean(outs) >= statistics.median(outs)            # right-skewed
    words = statistics.mean(len(r.prompt.split()) for r in requests)
    assert 0.6 * mean_in * 0.25 < words < 1.4 * mean_in * 0.25


def test_scale_shrinks_and_max_len_caps():
    small = generate_workload("long-doc", 50, seed=1, scale=0.05)
    big = generate_workload("long-doc", 50, seed=1, scale=0.5)
    assert sum(len(r.prompt) for r in small) < sum(len(r.prompt) for r in big) / 5
    capped = generate_workload("long-doc", 50, seed=1, scale=1.0, max_len=2048)
    assert all(len(r.prompt.split()) * 1.3 + r.max_tokens <= 2048 for r in capped)


def test_code_review_turns_resend_the_whole_history():
    requests = generate_workload("code-review", 30, seed=0, scale=0.05)
    follow_ups = [(i, r) for i, r in enumerate(requests) if r.after is not None]
    assert follow_ups
    for i, r in follow_ups:
        previous = requests[r.after]
        assert r.prompt.startswith(previous.prompt) and len(r.prompt) > len(previous.prompt)
    # Round-robin interleaving: a follow-up is not sent right behind its predecessor.
    assert any(i - r.after > 1 for i, r in follow_ups)


def test_ide_requests_share_file_prefixes():
    requests = generate_workload("ide-completion", 200, seed=0, scale=0.1)
    files = {r.prompt.split("\n", 1)[0] for r in requests}
    assert 10 < len(files) <= NUM_IDE_FILES


def test_mixed_has_every_scenario_and_valid_dependencies():
    requests = generate_workload("mixed", 120, seed=0, scale=0.05)
    assert {r.scenario for r in requests} == {"qa", "long-doc", "code-review", "ide-completion"}
    for r in requests:
        if r.after is not None:
            assert requests[r.after].scenario == "code-review"
            assert r.prompt.startswith(requests[r.after].prompt)


def test_bad_workload_arguments():
    with pytest.raises(ValueError, match="unknown workload"):
        generate_workload("chat", 1)
    with pytest.raises(ValueError, match="scale"):
        generate_workload("qa", 1, scale=0)
    with pytest.raises(ValueError, match="ttft:MS"):
        parse_goodput(["latency:5"])
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}


def test_summary_from_results_and_metrics_diff():
    text = ('# HELP x\nkvserve:prefix_cache_queries_total 100.0\nkvserve:prefix_cache_hits_total 40.0\n'
            'kvserve:kv_cache_evictions_total 2.0\nkvserve:request_success_total{finished_reason="stop"} 3\n')
    after = parse_prometheus(text)
    assert after['kvserve:request_success_total{finished_reason="stop"}'] == 3.0
    before = {"kvserve:prefix_cache_queries_total": 50.0, "kvserve:prefix_cache_hits_total": 10.0}
    results = [RequestResult("qa", ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5,
                             itl=[0.1] * 4),
               RequestResult("qa", ok=True, prompt_tokens=10, output_tokens=5, ttft=0.9, e2e=1.3,
                             itl=[0.1] * 4),
               RequestResult("qa", error="HTTP 503")]
    s = summarize(results, 2.0, before, after, [], {"ttft": 500})
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (2, 1, 10)
    assert s["goodput"] == 0.5 and s["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["server"]["prefix_cache_hit_rate"] == pytest.approx(0.6)
    assert s["server"]["evictions_per_s"] == pytest.approx(1.0)


def test_vllm_metrics_are_read_summed_over_their_labels():
    """vLLM's /metrics: its prefix-cache counters (tokens) and preemptions, one series per
    engine and model; the hit rate is theirs summed. A kvserve name with labels sums too."""
    labels = '{engine="%d",model_name="m"}'
    text = "\n".join([f"vllm:prefix_cache_queries_total{labels % e} {q}" for e, q in ((0, 300.0), (1, 100.0))]
                      + [f"vllm:prefix_cache_hits_total{labels % e} {h}" for e, h in ((0, 150.0), (1, 50.0))]
                      + [f"vllm:num_preemptions_total{labels % 0} 4.0", "vllm:kv_cache_usage_perc 0.25",
                         'vllm:prefix_cache_hits_created{engine="0"} 1.7e9'])
    before = parse_prometheus("vllm:prefix_cache_queries_total{engine=\"0\"} 100.0\n"
                              "vllm:prefix_cache_hits_total{engine=\"0\"} 40.0")
    s = summarize([RequestResult("qa", ok=True, e2e=1.0)], 1.0, before, parse_prometheus(text), [], {})
    assert s["server"]["prefix_cache_hit_rate"] == pytest.approx((200.0 - 40.0) / (400.0 - 100.0))
    assert s["server"]["preemptions"] == 4.0 and s["server"]["evictions"] == 0.0
    from kvserve.bench.serve import server_metric
    assert server_metric(parse_prometheus(text), "kv_cache_usage_perc") == 0.25


def test_arrival_times_are_the_poisson_gaps_summed():
    import itertools
    import random

    from kvserve.bench.serve import arrival_times
    rng, again = random.Random(3), random.Random(3)
    gaps = [again.expovariate(40.0) for _ in range(9)]
    times = arrival_times(10, 40.0, rng)
    assert times[0] == 0.0 and times[1:] == pytest.approx(list(itertools.accumulate(gaps)))
    assert arrival_times(4, float("inf"), rng) == [0.0] * 4


def test_a_busy_client_catches_up_with_the_schedule():
    """Requests are sent at their scheduled times, not after gaps measured from
    the last send: a client whose loop is busy 80% of the time (reading other
    streams) wakes late from every sleep, and with gaps those delays add up
    (~4 ms a request here, ~160 ms by the 40th)."""
    import asyncio
    import time

    from kvserve.bench.serve import run_benchmark
    from kvserve.bench.workloads import WorkloadRequest

    class Client:
        async def metrics(self):
            return {}

        async def complete(self, request):
            return RequestResult(request.scenario, ok=True)

    async def busy(stop: asyncio.Event) -> None:
        while not stop.is_set():
            time.sleep(0.008)            # holds the event loop, as parsing many streams does
            await asyncio.sleep(0.002)

    async def run():
        stop = asyncio.Event()
        loop_hog = asyncio.ensure_future(busy(stop))
        requests = [WorkloadRequest([1, 2, 3], 4, "qa", None) for _ in range(40)]
        results, *_ = await run_benchmark(Client(), requests, 100.0, None, 0, progress=False)
        stop.set()
        await loop_hog
        return results
    results = asyncio.run(run())
    lags = [r.sent - r.due for r in results]
    assert all(r.due is not None for r in results) and min(lags) >= 0
    assert lags[-1] < 0.05


def test_a_small_mixed_workload_may_hold_no_code_review():
    requests = generate_workload("mixed", 6, seed=0, scale=0.02, max_len=512)
    assert len(requests) == 6 and all(r.scenario != "code-review" and r.after is None for r in requests)


def test_client_processes_take_whole_conversations_in_schedule_order():
    """--client-processes: every request goes to exactly one process; a follow-up turn goes with
    the turn it waits for, its `after` renumbered to that turn's place in the process's list."""
    from kvserve.bench.serve_processes import owners, split
    requests = generate_workload("mixed", 60, seed=1)
    due = [i * 0.01 for i in range(len(requests))]
    owner = owners(requests, 3)
    assert all(owner[i] == owner[r.after] for i, r in enumerate(requests) if r.after is not None)
    firsts = [owner[i] for i, r in enumerate(requests) if r.after is None]
    assert firsts[:6] == [0, 1, 2, 0, 1, 2]
    parts = split(requests, due, 3)
    assert sorted(i for indices, _, _ in parts for i in indices) == list(range(len(requests)))
    for indices, mine, part_due in parts:
        assert part_due == [due[i] for i in indices] and part_due == sorted(part_due)
        for local, (i, r) in enumerate(zip(indices, mine)):
            assert r.prompt == requests[i].prompt
            if r.after is not None:
                assert indices[r.after] == requests[i].after and r.after < local


def test_client_process_warms_up_before_its_schedule(monkeypatch):
    """A client process sends `BenchClient.warm_up` before its first timed request, so its HTTP
    stack's set-up is not counted in that request's TTFT."""
    import asyncio
    import time
    from kvserve.bench import serve, serve_processes
    calls = []

    class Recorder:
        def __init__(self, *args):
            pass

        async def warm_up(self):
            calls.append(("warm_up", time.time()))

        async def complete(self, request):
            calls.append(("complete", time.time()))
            return serve.RequestResult(request.scenario)

        async def close(self):
            calls.append(("close", time.time()))
    monkeypatch.setattr(serve, "BenchClient", Recorder)
    requests = generate_workload("qa", 2, seed=0)
    start_wall = time.time() + 0.5
    rows = asyncio.run(serve_processes._part("http://x", "m", True, 5.0, requests, [0.0, 0.01], start_wall, None))
    assert [name for name, _ in calls] == ["warm_up", "complete", "complete", "close"]
    assert calls[0][1] < start_wall <= calls[1][1] + 0.005
    assert len(rows) == 2 and all(r.sent >= 0.0 for r in rows)
