"""Request timelines from a live server whose engine core runs in its own
process (`kvserve serve`'s path, the embedded model), and `kvserve diagnose
--url` reading them: on an 8-token budget, 48-token prompts make
`token_budget_too_small` the top finding with the sizing rule's numbers,
while prompts that fit the budget stay `healthy` (one server for both: a
second start of the model would cost more than every test here together);
/debug/kvserve's timelines are consistent with themselves. Plus the core loop
answering a debug query in-process (fake transport, tiny dummy model).
"""
from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

import kvserve.diagnose.sources as sources
from kvserve.cli import main
from kvserve.config import EngineArgs
from kvserve.server.app import build_app
from tests.test_server import LiveServer

BUDGET, PROMPT_TOKENS, SHORT_PROMPT_TOKENS, NUM_REQUESTS = 8, 48, 6, 3


@pytest.fixture(scope="module")
def one_thread():
    # The spawned core inherits the environment. One torch thread: on a small
    # shared CPU, threads spinning against other jobs make each step seconds long.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def server(one_thread):
    args = EngineArgs(max_model_len=256, block_size=8, max_num_seqs=4, max_num_batched_tokens=BUDGET)
    with LiveServer(build_app(args, "m")) as live:
        yield live


def _prompts(seed: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(length)] for _ in range(NUM_REQUESTS)]


def _complete(url: str, prompt: list[int], max_tokens: int = 2) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()


def _send_all(url: str, prompts: list[list[int]]) -> None:
    threads = [threading.Thread(target=_complete, args=(url, p)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _diagnose_during_load(server: LiveServer, prompts, monkeypatch, capsys) -> dict:
    """`kvserve diagnose --url --json` on a thread; the load goes out once its
    first poll is back, and the window closes when every request finished."""
    polled, get = threading.Event(), sources._get
    monkeypatch.setattr(sources, "_get", lambda *a, **k: (get(*a, **k), polled.set())[0])
    argv = ["diagnose", "--url", server.url, "--json", "--duration", "120", "--period", "0.2",
            "--requests", str(len(prompts))]
    cli = threading.Thread(target=main, args=(argv,))
    cli.start()
    assert polled.wait(30)
    _send_all(server.url, prompts)
    cli.join(timeout=130)
    assert not cli.is_alive()
    return json.loads(capsys.readouterr().out)


def test_token_budget_far_below_prompts_online(server, monkeypatch, capsys):
    result = _diagnose_during_load(server, _prompts(0), monkeypatch, capsys)
    top = result["findings"][0]
    assert top["code"] == "token_budget_too_small", result["findings"]
    ev = result["evidence"]
    assert ev["requests_with_timeline"] == NUM_REQUESTS and ev["mean_prompt_tokens"] == PROMPT_TOKENS
    # 48-token prompts under an 8-token budget: at least 6 chunks each.
    assert ev["prefill_chunks_mean"] >= PROMPT_TOKENS / 8 and ev["prompts_chunked_share"] == 1.0
    split = ev["ttft_queue_ms"] + ev["ttft_prefill_ms"] + ev["ttft_first_decode_ms"]
    assert split == pytest.approx(ev["ttft_mean_ms"], rel=1e-6)
    # mean sequence (48 + 2) x measured concurrency x 1.5, in blocks of 8, at least one prompt.
    budget = int(top["fix"].split()[1])
    assert budget >= PROMPT_TOKENS and budget % 8 == 0 and "x 1.5" in top["fix"]
    worst = result["worst_requests"]
    assert len(worst["ttft"]) == len(worst["e2e"]) == NUM_REQUESTS
    assert all("chunked into many steps" in w["reasons"] for w in worst["ttft"])
    assert worst["ttft"][0]["ttft_ms"] >= worst["ttft"][-1]["ttft_ms"]


def _times(timeline: list[dict], event: str) -> list[float]:
    return [e["t"] for e in timeline if e["event"] == event]


def test_debug_endpoint_timelines_are_consistent(server):
    prompt = _prompts(1)[0]
    _complete(server.url, prompt)
    _complete(server.url, prompt)   # the same prompt again: its full blocks come from the cache
    body = httpx.get(f"{server.url}/debug/kvserve").json()
    assert body["config"]["max_num_batched_tokens"] == BUDGET and body["config"]["bytes_per_block"] > 0
    assert [g["spec"] for g in body["kv_groups"]] == ["full"]
    assert body["metrics"]["num_requests_finished"] >= 2
    requests = body["requests"]
    assert requests and any(r["cached_tokens"] == PROMPT_TOKENS - 8 for r in requests)   # all but the last block
    for r in requests:
        timeline = r["timeline"]
        arrival, = _times(timeline, "arrival")
        scheduled, first_token, finish = (_times(timeline, e)[0] for e in ("scheduled", "first_token", "finish"))
        chunks = [e for e in timeline if e["event"] == "prefill"]
        assert arrival <= scheduled <= chunks[0]["t"] <= first_token <= finish, timeline
        assert r["num_preemptions"] == 0
        assert sum(e["tokens"] for e in chunks) == r["prompt_tokens"] - r["cached_tokens"], r
        assert [e["t"] for e in timeline] == sorted(e["t"] for e in timeline)


def test_prompts_that_fit_the_budget_are_healthy_online(server, monkeypatch, capsys):
    result = _diagnose_during_load(server, _prompts(2, SHORT_PROMPT_TOKENS), monkeypatch, capsys)
    assert result["findings"][0]["code"] == "healthy", result["findings"]
    assert result["evidence"]["requests_with_timeline"] == NUM_REQUESTS
    # Three 6-token prompts share one 8-token budget: at most a split in two, never the rule's 3.
    assert result["evidence"]["prefill_chunks_mean"] < 3


def test_core_answers_a_debug_query_before_stepping():
    from kvserve.engine.core_process import EngineCore
    from kvserve.diagnose.recorder import request_records
    from kvserve.engine.core_protocol import CoreInputs
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams
    from tests.test_engine_core_process import FakeTransport
    llm = LLM("dummy:tiny-llama", load_format="dummy", device="cpu", dtype="float32", block_size=8,
              max_model_len=64, num_kv_blocks=20)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(max_tokens=2, ignore_eos=True))
    transport = FakeTransport()
    core = EngineCore(llm.engine, transport)
    transport.inbox.append(CoreInputs(debug=["q1", "q2"]))
    assert core.run_once()
    reply, = [m for m in transport.sent if m.debug]   # (an idle core also reports its metrics once)
    assert [r.query_id for r in reply.debug] == ["q1", "q2"] and not reply.outputs and reply.metrics is None
    snapshot = reply.debug[0].snapshot
    assert snapshot["config"]["block_size"] == 8 and snapshot["kv_groups"][0]["spec"] == "full"
    finished, = request_records(snapshot["requests"])   # rows in the core, dicts in the route
    assert finished["prompt_tokens"] == 5 and finished["output_tokens"] == 2
    assert [e["event"] for e in finished["timeline"]] == ["arrival", "scheduled", "prefill", "first_token",
                                                          "finish"]
