"""The OpenAI-compatible server, started for real on a loopback port and driven
with the official `openai` client (plus raw httpx where status codes, headers
and error bodies are the point).

Text endpoints use the embedded SmolLM2 model (one server per module); the
concurrency and overload tests use a tiny random-weight checkpoint, which has
no tokenizer, so they send token-id prompts.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from kvserve.bench.serve import parse_prometheus
from kvserve.config import EngineArgs
from kvserve.server.app import build_app
from tests.tiny_models import save_tiny_checkpoint

MODEL = "SmolLM2-135M-Instruct"


class LiveServer:
    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(httpx.get(f"{self.url}/metrics").text)

    def wait_idle(self, timeout: float = 15.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["kvserve:kv_cache_usage_perc"] == 0 and m["kvserve:num_requests_running"] == 0
                    and m["kvserve:num_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


@pytest.fixture(scope="module")
def embedded():
    # The engine core runs in its own process, as under `kvserve serve`.
    app = build_app(EngineArgs(max_model_len=2048), MODEL)
    with LiveServer(app) as server:
        server.engine = app.state.async_engine.engine   # tokenizer and configs, API side
        yield server


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")


def _tiny_server(path, **kwargs) -> LiveServer:
    max_waiting = kwargs.pop("max_waiting_requests", None)
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", **kwargs)
    return LiveServer(build_app(args, "tiny", max_waiting))


# -- completions and chat -------------------------------------------------------------------
def test_models_and_health(embedded):
    models = embedded.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{embedded.url}/health").status_code == 200


def test_completion_usage_and_stream_agree(embedded):
    client, prompt = embedded.client(), "The capital of France is"
    num_prompt = len(embedded.engine.tokenizer.encode(prompt, add_special_tokens=False))
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert "Paris" in full.choices[0].text
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == \
        (num_prompt, 6, num_prompt + 6)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == num_prompt


def test_chat_stream_and_not(embedded):
    client = embedded.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant"
    template_ids = embedded.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    template_ids = template_ids["input_ids"] if hasattr(template_ids, "keys") else template_ids
    assert reply.usage.prompt_tokens == len(template_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_repeated_long_prefix_reports_cached_tokens(embedded):
    client = embedded.client()
    prompt = "Here is a long shared context about caches. " * 12 + "Question one?"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    # Ended by a stop string on the API side, after middle tokens that travel without a
    # cached-token count (the core's columns): the count from the first output must stay.
    kwargs = dict(model=MODEL, prompt=prompt[:-4] + "two?", max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**{**kwargs, "max_tokens": 16}, stop=[text[-2:]])
    assert second.choices[0].finish_reason == "stop" and second.usage.completion_tokens < 16
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_n_seed_stop_and_logprobs(embedded):
    client = embedded.client()
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=7, n=3,
                  extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]       # seeded
    assert len({c.text for c in a.choices}) > 1                             # distinct child seeds
    assert a.usage.completion_tokens == 15
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert streamed == [c.text for c in a.choices]
    assert a.usage.prompt_tokens == len(embedded.engine.tokenizer.encode("Once upon a time"))  # billed once
    stopped = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10,
                                        temperature=0, stop=["."])
    assert stopped.choices[0].text == " Paris" and stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10,
                                         temperature=0, stop=["."], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == " Paris"
    lp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                   temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and all(x <= 0 for x in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


# -- validation -----------------------------------------------------------------------------
def _post(server, path, body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _error(response, status) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_context_overflow_names_both_numbers(embedded):
    error = _error(_post(embedded, "/v1/completions", {"model": MODEL, "prompt": "Hello there",
                                                       "max_tokens": 2047}), 400)
    assert "max_tokens (2047)" in error["message"] and "max_model_len=2048" in error["message"]
    assert error["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="2048"):
        embedded.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5000)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
])
def test_bad_types_and_ranges_are_400(embedded, path, body, param):
    error = _error(_post(embedded, path, {"model": MODEL, **body}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_malformed_json_and_unknown_model(embedded):
    response = httpx.post(f"{embedded.url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    _error(response, 400)
    error = _error(_post(embedded, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404)
    assert "gpt-9" in error["message"] and error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        embedded.client().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_a_model_path_is_served_under_its_basename_and_as_given(tiny_path):
    """vLLM's default served name is `--model` as given; kvserve's is the
    basename. Both are listed and accepted; responses carry the basename."""
    from kvserve.server.app import default_model_names
    names = default_model_names(str(tiny_path))
    assert names == [tiny_path.name, str(tiny_path)]
    with LiveServer(build_app(EngineArgs(model=str(tiny_path), dtype="float32", device="cpu"), names)) as server:
        listed = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
        assert listed == names
        for name in names:
            reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                               json={"model": name, "prompt": [5, 6, 7], "max_tokens": 2})
            assert reply.status_code == 200 and reply.json()["model"] == tiny_path.name
        error = _error(httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": [5]}), 404)
        assert error["code"] == "model_not_found" and str(tiny_path) in error["message"]


def test_metrics_exposes_the_documented_names(embedded):
    text = httpx.get(f"{embedded.url}/metrics").text
    for name in ("kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "kv_cache_evictions_total", "num_preemptions_total", "kv_cache_fragmentation",
                 "num_requests_running", "num_requests_waiting", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "request_prefill_time_seconds_bucket"):
        assert f"kvserve:{name}" in text, name
    info = next(line for line in text.splitlines() if line.startswith("kvserve:cache_config_info"))
    assert 'block_size="16"' in info and 'groups="0:fullx30"' in info
    m = parse_prometheus(text)
    assert m["kvserve:prefix_cache_hits_total"] > 0
    assert m["kvserve:generation_tokens_total"] >= m["kvserve:time_to_first_token_seconds_count"]


def test_bench_serve_runs_against_the_server(embedded, tmp_path, capsys):
    from kvserve.cli import main
    out = tmp_path / "r.json"
    assert main(["bench", "serve", "--url", embedded.url, "--workload", "ide-completion",
                 "--num-prompts", "4", "--request-rate", "20", "--scale", "0.02",
                 "--goodput", "ttft:60000", "--save-json", str(out)]) == 0
    saved = json.loads(out.read_text())
    summary, rows = saved["summary"], saved["requests"]
    assert summary["completed"] == 4 and summary["failed"] == 0
    # Per request: sent in arrival order within the run, latencies as the summary's.
    sent = sorted(r["sent_s"] for r in rows)
    assert len(rows) == 4 and 0 <= sent[0] and sent[-1] < summary["duration_s"]
    mean_ttft = sum(r["ttft_ms"] for r in rows) / len(rows)
    assert mean_ttft == pytest.approx(summary["ttft_ms"]["mean"], abs=0.01)
    assert summary["server"]["prefix_cache_hit_rate"] > 0      # shared file prefixes
    assert "TTFT" in capsys.readouterr().out


def test_bench_serve_from_two_client_processes(embedded, tmp_path):
    """--client-processes 2: every request completes, sent on the one schedule (none before it is
    due, the lead time for starting the processes not counted in the run)."""
    from kvserve.cli import main
    out = tmp_path / "r.json"
    assert main(["bench", "serve", "--url", embedded.url, "--workload", "mixed", "--num-prompts", "6",
                 "--request-rate", "20", "--scale", "0.02", "--client-processes", "2",
                 "--save-json", str(out)]) == 0
    saved = json.loads(out.read_text())
    summary, rows = saved["summary"], saved["requests"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert all(r["sent_s"] >= r["due_s"] - 1e-3 for r in rows if r["due_s"] is not None)
    assert 0 <= min(r["sent_s"] for r in rows) < 1.0 and max(r["sent_s"] for r in rows) < summary["duration_s"]


# -- concurrency, disconnects, overload (tiny model) ------------------------------------------
async def _stream_client(client: openai.AsyncOpenAI, i: int, disconnect: bool) -> tuple[int, str | None]:
    """(tokens the usage chunk counts, finish reason), or (chunks read, "disconnected").
    Chunks are not counted as tokens: a reader that falls behind gets several tokens a chunk."""
    prompt = [3 + (i * 7 + j) % 200 for j in range(16)]
    stream = await client.completions.create(model="tiny", prompt=prompt, stream=True, temperature=0,
                                             max_tokens=480 if disconnect else 24,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    received, tokens, finish = 0, 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        received += len(chunk.choices)
        finish = chunk.choices[0].finish_reason or finish
        if disconnect and received == 3:
            await stream.close()
            return received, "disconnected"
    return tokens, finish


def test_32_streams_with_a_third_disconnecting(tiny_path):
    with _tiny_server(tiny_path) as server:
        async def run():
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            results = await asyncio.gather(*(_stream_client(client, i, i % 3 == 0) for i in range(32)))
            await client.close()
            return results
        results = asyncio.run(run())
        for i, (received, finish) in enumerate(results):
            if i % 3 == 0:
                assert finish == "disconnected"
            else:
                assert (received, finish) == (24, "length"), i
        m = server.wait_idle()
        assert m["kvserve:kv_cache_usage_perc"] == 0.0
        assert m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
        assert m['kvserve:request_success_total{finished_reason="abort"}'] == 11
        assert m['kvserve:request_success_total{finished_reason="length"}'] == 21


def test_full_waiting_queue_answers_429_with_retry_after(tiny_path):
    with _tiny_server(tiny_path, max_num_seqs=1, max_waiting_requests=1) as server:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as first, \
                    http.stream("POST", "/v1/completions", json=body) as second:
                assert first.status_code == second.status_code == 200
                rejected = http.post("/v1/completions", json={**body, "stream": False})
                error = _error(rejected, 429)
                assert rejected.headers["retry-after"] == "1" and error["type"] == "server_overloaded"
        m = server.wait_idle()
        assert m["kvserve:kv_cache_usage_perc"] == 0.0
