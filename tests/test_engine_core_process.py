"""The engine core in its own process, seen from the API server: aborts and
disconnects reach the core and free its blocks; a core that dies or raises
fails every open request with an OpenAI-style error and turns /health to 503,
and nothing hangs. Plus the core loop itself, in-process with a fake transport:
one message per step for all requests, accept/reject before the step.

Servers are real (`kvserve serve`'s path: EngineArgs -> a spawned core) on a
tiny random-weight checkpoint with no tokenizer, so prompts are token ids.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import math
import multiprocessing.connection
import os
import random
import signal
from types import SimpleNamespace

import httpx
import openai
import pytest

from kvserve.config import EngineArgs
from kvserve.engine.core_client import ProcessCoreClient
from kvserve.engine.core_process import EngineCore
from kvserve.engine.core_protocol import CoreInputs, CoreJob, CoreOutputs, CoreRequest, pack_sampling_params
from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app
from kvserve.server.async_engine import AsyncEngine, Delta, EngineDeadError, Job
from kvserve.server.serving import GenerationHandler, _ClosingStream, _Format
from tests.test_server import LiveServer
from tests.tiny_models import save_tiny_checkpoint

LONG = 2000   # tokens a request would generate if its abort never reached the core


@pytest.fixture(scope="module")
def tiny_args(tmp_path_factory) -> EngineArgs:
    path = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama",
                                max_position_embeddings=4096)
    return EngineArgs(model=str(path), dtype="float32", device="cpu", max_model_len=4096)


def _prompt(i: int) -> list[int]:
    return [3 + (i * 11 + j) % 250 for j in range(16)]


async def _read_then_leave(client: openai.AsyncOpenAI, i: int, num_chunks: int) -> int:
    stream = await client.completions.create(model="tiny", prompt=_prompt(i), stream=True, max_tokens=LONG,
                                             temperature=0, extra_body={"ignore_eos": True})
    received = 0
    async for _ in stream:
        received += 1
        if received == num_chunks:
            break
    await stream.close()
    return received


async def _post_then_leave(url: str, i: int) -> None:
    body = {"model": "tiny", "prompt": _prompt(i), "max_tokens": LONG, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=1.0) as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post(f"{url}/v1/completions", json=body)


@pytest.fixture(scope="module")
def tiny_server(tiny_args):
    with LiveServer(build_app(tiny_args, "tiny")) as server:
        yield server


def _count(m: dict[str, float], reason: str) -> float:
    return m.get(f'kvserve:request_success_total{{finished_reason="{reason}"}}', 0.0)


def test_disconnect_storm_leaves_no_block_in_use(tiny_server):
    """48 streams leave after 1-6 chunks; had an abort not reached the core,
    its request would run on to LONG tokens."""
    rng, before = random.Random(0), tiny_server.wait_idle()

    async def storm():
        client = openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)
        await asyncio.gather(*(_read_then_leave(client, i, rng.randint(1, 6)) for i in range(48)))
        await client.close()
    asyncio.run(storm())
    m = tiny_server.wait_idle(timeout=60)
    assert m["kvserve:kv_cache_usage_perc"] == 0.0
    assert m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
    assert _count(m, "abort") - _count(before, "abort") == 48
    assert _count(m, "length") == _count(before, "length")
    generated = m["kvserve:generation_tokens_total"] - before.get("kvserve:generation_tokens_total", 0)
    assert generated < 48 * LONG / 4
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


def test_a_client_that_leaves_during_a_send_aborts_at_once():
    """Starlette cancels the task that is sending a chunk; the stream and its
    `deltas` generator, suspended at their `yield`s, must close then (closing
    `deltas` aborts the request), not when the garbage collector finds them."""
    closed = []

    class Engine:
        async def deltas(self, sub):
            try:
                for i in range(1000):
                    yield Delta(0, [i], str(i), None)
                    await asyncio.sleep(0)
            finally:
                closed.append(sub)

    handler = GenerationHandler.__new__(GenerationHandler)
    handler.engine, sub = Engine(), SimpleNamespace(job=SimpleNamespace(num_choices=1, n=1))
    response = _ClosingStream(handler._stream(sub, _Format(None, None), {"id": "cmpl-1"}, [4], False))
    client_left = asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.body":
            client_left.set()
            await asyncio.Event().wait()   # the socket never drains: cancelled here

    async def receive():
        await client_left.wait()
        return {"type": "http.disconnect"}

    async def serve():
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        return list(closed)
    gc.disable()   # only an explicit close may count
    try:
        assert asyncio.run(serve()) == [sub]
    finally:
        gc.enable()


def test_shutdown_of_a_core_that_exited_neither_warns_nor_kills(tiny_args, caplog):
    """The watcher thread reaps the core (its `join`). Shutdown, on another
    thread, used to `join` and `is_alive` too: when the watcher's waitpid won,
    the exited core looked alive, and shutdown logged "did not stop in 10 s"
    and killed its pid (3 of 5 server shutdowns did). The reap is done here by
    hand, before shutdown, to make that order certain."""
    client = ProcessCoreClient(tiny_args, None)
    client.send(CoreInputs(shutdown=True))
    assert multiprocessing.connection.wait([client.process.sentinel], 60)
    os.waitpid(client.process.pid, 0)   # as the watcher's join does
    kill = client.process.kill
    client.process.kill = lambda: pytest.fail("shutdown killed the pid of an exited core")
    try:
        with caplog.at_level(logging.WARNING, logger="kvserve.engine.core_client"):
            client.shutdown()
    finally:
        client.process.kill = kill
    assert "did not stop" not in caplog.text


def test_non_streaming_clients_that_leave_free_their_blocks(tiny_server):
    before = tiny_server.wait_idle()

    async def leave():
        await asyncio.gather(*(_post_then_leave(tiny_server.url, 100 + i) for i in range(8)))
    asyncio.run(leave())
    m = tiny_server.wait_idle(timeout=20)
    assert m["kvserve:kv_cache_usage_perc"] == 0.0 and m["kvserve:num_requests_running"] == 0
    # A timed-out POST the server had not started handling never became a request.
    assert 0 < _count(m, "abort") - _count(before, "abort") <= 8


async def _stream_until_error(client: openai.AsyncOpenAI, i: int, started: asyncio.Event,
                              num_started: list[int], want: int) -> str:
    stream = await client.completions.create(model="tiny", prompt=_prompt(i), stream=True, max_tokens=LONG,
                                             temperature=0, extra_body={"ignore_eos": True})
    received = 0
    try:
        async for _ in stream:
            received += 1
            if received == 2:
                num_started[0] += 1
                if num_started[0] == want:
                    started.set()
    except openai.APIError as e:
        return str(e)
    return f"ended without an error after {received} chunks"


def test_killing_the_core_mid_stream_fails_every_open_request(tiny_args):
    app = build_app(tiny_args, "tiny")
    core = app.state.async_engine.core
    with LiveServer(app) as server:
        async def run():
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            started, num_started = asyncio.Event(), [0]
            body = {"model": "tiny", "prompt": _prompt(99), "max_tokens": LONG, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=60) as http:
                plain = asyncio.ensure_future(http.post(f"{server.url}/v1/completions", json=body))
                streams = [asyncio.ensure_future(_stream_until_error(client, i, started, num_started, 8))
                           for i in range(8)]
                await asyncio.wait_for(started.wait(), 60)
                os.kill(core.pid, signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*streams), 30)   # nothing hangs
                plain_response = await asyncio.wait_for(plain, 30)
            await client.close()
            return results, plain_response
        results, plain = asyncio.run(run())
        assert all("engine" in r and "ended without" not in r for r in results), results
        assert plain.status_code == 500 and plain.json()["error"]["code"] == "engine_dead"
        assert httpx.get(f"{server.url}/health").status_code == 503
        refused = httpx.post(f"{server.url}/v1/completions", timeout=30,
                             json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}


def fail_on_fifth_step(engine) -> None:
    """engine_hook for the core process: its 5th step raises (a bug in the core)."""
    step, calls = engine.step, [0]

    def failing_step(emit=None):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected core failure")
        return step(emit)
    engine.step = failing_step


def test_a_core_that_raises_fails_its_requests_and_turns_unhealthy(tiny_args):
    async def run():
        engine = AsyncEngine(tiny_args, engine_hook=fail_on_fifth_step)
        engine.start()
        try:
            job = Job([_prompt(1), _prompt(2)], {"temperature": 0.0, "ignore_eos": True}, 100)
            sub, prompt_lens = await engine.submit(job)
            assert prompt_lens == [16, 16]
            received = []
            with pytest.raises(EngineDeadError, match="injected core failure"):
                async for delta in engine.deltas(sub):
                    received.append(delta)
            assert 0 < len(received) < 10
            await asyncio.sleep(0.5)
            assert not engine.is_healthy
            with pytest.raises(EngineDeadError) as refused:
                await engine.submit(job)
            assert refused.value.status == 503
            assert engine.num_in_flight == 0
        finally:
            engine.shutdown()
    asyncio.run(asyncio.wait_for(run(), 120))


def refuse_unfrozen_heap(engine) -> None:
    """engine_hook for the core process: a step on an unfrozen start-up heap raises."""
    step = engine.step

    def checked_step(emit=None):
        if gc.get_freeze_count() == 0:
            raise RuntimeError("the start-up heap was not frozen")
        return step(emit)
    engine.step = checked_step


def test_the_core_freezes_its_start_up_heap(tiny_args):
    """Full collections must not walk the model and block pool on the step
    loop: the core freezes what start-up built before it serves."""
    async def run():
        engine = AsyncEngine(tiny_args, engine_hook=refuse_unfrozen_heap)
        engine.start()
        try:
            sub, _ = await engine.submit(Job([_prompt(3)], {"temperature": 0.0, "ignore_eos": True}, 4))
            received = [delta async for delta in engine.deltas(sub)]
            assert received and engine.is_healthy
        finally:
            engine.shutdown()
    asyncio.run(asyncio.wait_for(run(), 120))


# -- the core loop, in-process ------------------------------------------------------------
class FakeTransport:
    def __init__(self) -> None:
        self.inbox: list[CoreInputs] = []
        self.sent: list[CoreOutputs] = []

    def recv(self, timeout_s):
        items, self.inbox = self.inbox, []
        return items

    def send(self, outputs: CoreOutputs) -> None:
        self.sent.append(outputs)


def _request(request_id: str, prompt: list[int], **params) -> CoreRequest:
    packed, grammar = pack_sampling_params(SamplingParams(temperature=0.0, ignore_eos=True, **params))
    return CoreRequest(request_id, prompt, packed, 0.0, grammar)


def test_core_sends_one_message_per_step_and_answers_adds_before_stepping(tiny_args):
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(tiny_args)
    transport = FakeTransport()
    core = EngineCore(engine, transport)
    good = CoreJob("a", [_request(f"a{i}", _prompt(i), max_tokens=6) for i in range(4)])
    bad = CoreJob("b", [_request("b0", _prompt(9), max_tokens=6), _request("b1", [10**6], max_tokens=6)])
    transport.inbox.append(CoreInputs(adds=[good, bad]))
    assert core.run_once()
    replies = [m for m in transport.sent if m.accepted or m.rejected]
    assert len(replies) == 1 and not replies[0].outputs     # answered before the step ran
    reply = replies[0]
    assert reply.accepted == ["a"] and [r.job_id for r in reply.rejected] == ["b"]
    assert reply.rejected[0].invalid and "vocabulary" in reply.rejected[0].message
    assert "b0" not in engine.requests            # a rejected job adds none of its requests
    while engine.has_unfinished_requests():
        core.run_once()
    steps = [m for m in transport.sent if m.outputs or m.next_ids]
    for message in steps:                          # every request's token rides in the same message
        assert sorted(o.request_id for o in message.every_output()) == ["a0", "a1", "a2", "a3"]
    assert any(m.next_ids for m in steps) and any(m.outputs for m in steps)   # columns on steady steps
    tokens = {f"a{i}": [] for i in range(4)}
    for message in steps:
        for out in message.every_output():
            tokens[out.request_id] += out.new_token_ids
    assert all(len(t) == 6 for t in tokens.values())
    assert [o.finish_reason for o in steps[-1].every_output()] == ["length"] * 4
    core.run_once()                    # idle: one final metrics snapshot
    assert transport.sent[-1].metrics["kv_cache_usage_perc"] == 0.0
    transport.inbox.append(CoreInputs(adds=[CoreJob("c", [_request("c0", _prompt(5), max_tokens=6)])]))
    core.run_once()   # within METRICS_INTERVAL_S of the idle one, but the busy snapshot must go out
    assert transport.sent[-1].metrics["num_requests_running"] == 1


def test_a_job_the_core_cannot_read_is_rejected_alone(tiny_args):
    """A value of the wrong type in one job (a tensor among its token ids: it
    travels pickled, as a msgpack extension) failed the typed decoding of the whole
    message, and the engine core died with every request. Now that job alone is
    rejected (an engine fault, not the client's) and the others run."""
    import msgspec
    import torch
    from kvserve.engine.core_process import ZmqTransport
    from kvserve.engine.core_protocol import Codec, salvage_inputs
    from kvserve.engine.llm_engine import LLMEngine
    good = CoreJob("a", [_request("a0", _prompt(1), max_tokens=3)])
    bad = CoreJob("b", [_request("b0", [1, torch.tensor(2)], max_tokens=3)])
    wire = Codec(CoreInputs).encode(CoreInputs(adds=[good, bad], aborts=["gone"]))
    with pytest.raises(msgspec.ValidationError):
        Codec(CoreInputs).decode(wire)
    message = ZmqTransport._decode(SimpleNamespace(_in_codec=Codec(CoreInputs)), wire)
    assert message == salvage_inputs(wire)
    assert [j.job_id for j in message.adds] == ["a"] and message.aborts == ["gone"]
    assert [job_id for job_id, _ in message.unreadable] == ["b"]
    engine, transport = LLMEngine(tiny_args), FakeTransport()
    core = EngineCore(engine, transport)
    transport.inbox.append(message)
    assert core.run_once()
    reply = next(m for m in transport.sent if m.accepted or m.rejected)
    assert reply.accepted == ["a"] and [(r.job_id, r.invalid) for r in reply.rejected] == [("b", False)]
    assert reply.rejected[0].message.startswith("the engine core could not read this job: ")
    while engine.has_unfinished_requests():
        assert core.run_once()
    assert "b0" not in engine.requests


def test_core_abort_frees_blocks_and_stops_outputs(tiny_args):
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(tiny_args)
    transport = FakeTransport()
    core = EngineCore(engine, transport)
    transport.inbox.append(CoreInputs(adds=[CoreJob("a", [_request("a0", _prompt(0), max_tokens=500),
                                                          _request("a1", _prompt(1), max_tokens=500)])]))
    for _ in range(4):
        core.run_once()
    assert engine.kv_cache.usage > 0
    transport.inbox.append(CoreInputs(aborts=["a0"]))
    num_sent = len(transport.sent)
    core.run_once()
    later = [o.request_id for m in transport.sent[num_sent:] for o in m.every_output()]
    assert "a0" not in later and "a1" in later
    transport.inbox.append(CoreInputs(aborts=["a1", "never-added"]))
    for _ in range(3):
        core.run_once()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.usage == 0.0


@pytest.mark.parametrize("model", ["llama", "dummy:tiny-deepseek-v4"])
def test_the_step_trace_records_every_step_with_its_shape(model, tiny_args, tmp_path, monkeypatch):
    """KVSERVE_STEP_TRACE: one line per step, with the launched step's rows and
    prompt tokens, and a summary that splits prefill-carrying from decode-only steps.
    KVSERVE_CORE_PROFILE: a cProfile of the same steps."""
    from kvserve.engine import step_trace
    from kvserve.engine.llm_engine import LLMEngine
    path = tmp_path / "steps.tsv"
    monkeypatch.setenv(step_trace.ENV, str(path))
    monkeypatch.setenv(step_trace.PROFILE_ENV, str(tmp_path / "steps.prof"))
    monkeypatch.setattr(step_trace, "FLUSH_EVERY", 3)   # batches reach the file, and the rest at exit
    if model != "llama":   # DeepSeek V4's runner is a ModelRunner of its own
        tiny_args = EngineArgs(model=model, dtype="float32", device="cpu", max_model_len=256)
    engine = LLMEngine(tiny_args)
    transport = FakeTransport()
    core = EngineCore(engine, transport)
    transport.inbox.append(CoreInputs(adds=[CoreJob("a", [_request(f"a{i}", _prompt(i), max_tokens=5)
                                                          for i in range(3)])]))
    core.run_once()                               # the adds, then the first step
    while engine.has_unfinished_requests():
        core.run_once()
    transport.inbox.append(CoreInputs(shutdown=True))
    core.serve()                                  # takes the shutdown; flushes what is left
    steps = step_trace.read(str(path))
    assert len(steps) == engine.stats.num_steps + 1   # + the step that only resolved the last one
    assert [s["prompt_tokens"] for s in steps[:2]] == [48, 0] and steps[0]["rows"] == 3
    assert steps[-1]["rows"] == steps[-1]["prompt_tokens"] == 0   # nothing launched: the last step only waited
    assert all(s["step_ms"] >= s["wait_ms"] >= 0 and s["step_ms"] >= s["gc_ms"] >= 0 for s in steps)
    assert [s["eager"] for s in steps] == [1] * (len(steps) - 1) + [0]   # a CPU engine has no graphs
    text = step_trace.summary(steps)
    assert "mixed/eager" in text and "decode/eager" in text
    profile = (tmp_path / "steps.prof").read_text()
    assert profile.startswith(f"{len(steps)} steps") and "llm_engine.py" in profile and "(step)" in profile


def test_a_gpu_core_runs_its_host_ops_on_one_torch_thread(monkeypatch):
    """A CUDA core drops torch's intra-op pool to one thread (its pool only
    contends with the server's processes); OMP_NUM_THREADS overrides that,
    and a CPU engine, which computes on those threads, keeps them."""
    import torch

    from kvserve.engine import core_process
    calls = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def engine(device: str):
        return SimpleNamespace(runner=SimpleNamespace(device=torch.device(device)))
    core_process.limit_host_threads(engine("cpu"))
    assert calls == []
    core_process.limit_host_threads(engine("cuda"))
    assert calls == [1]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    core_process.limit_host_threads(engine("cuda"))
    assert calls == [1]


def test_the_step_trace_gives_each_step_the_device_time_the_next_line_waited_for():
    """Pipelined steps: the line that launches step i waits for step i - 1, so
    step i's device time is the next line's period, not its own. A synthetic
    trace (ms): a 12 ms mixed step between 6 ms decodes, then 1.5 s idle."""
    from kvserve.engine import step_trace
    starts = [0, 6, 12, 24, 30, 36, 1536, 1542, 1548]
    shapes = [0, 200, 0, 0, 0, 0, 0, 0, 0]

    def line(start, prompt):
        return {"start_s": start / 1e3, "step_ms": 5.0, "wait_ms": 4.0 if prompt == 0 else 0.0,
                "out_ms": 0.1, "rows": 8, "prompt_tokens": prompt, "eager": 0, "gc_ms": 0.0}
    steps = [line(t, p) for t, p in zip(starts, shapes)]
    rows = step_trace.with_periods(steps)
    mixed = [r for r in rows if r["prompt_tokens"]]
    assert len(mixed) == 1 and mixed[0]["device_ms"] == pytest.approx(12.0)
    assert mixed[0]["host_ms"] == pytest.approx(5.0)
    assert all(r["device_ms"] == pytest.approx(6.0) for r in rows if not r["prompt_tokens"])
    assert len(rows) == 5   # none for lines next to the idle stretch or without two successors
    segments = step_trace.busy_segments(steps)
    assert [len(s) for s in segments] == [6, 3]


def test_the_step_trace_fits_a_decode_steps_cost_per_running_row(tmp_path):
    """Graph decode steps timed 5 ms + 50 us a row (4 to 40 rows), their device spans 4 ms + 40 us
    a row: the summary's by-rows line bins the periods by 8 rows and recovers intercept and slope,
    the span's fit line recovers its own (each step's span is in the line after it, which
    resolves it); the reader takes a gzipped trace as stage 4 of the comparison script leaves it,
    and one written before the span column."""
    import gzip

    from kvserve.engine import step_trace
    rows = [4 + (i * 7) % 37 for i in range(60)]
    starts = [0.0, 5.0]
    for r in rows[:-2]:   # line i's step is what the line after i + 1 waited for: its period
        starts.append(starts[-1] + 5.0 + 0.05 * r)
    spans = ["nan"] + [f"{4.0 + 0.04 * r:.3f}" for r in rows[:-1]]   # line i resolves step i - 1
    body = "".join(f"{t / 1e3}\t1.0\t0.5\t0.1\t{r}\t0\t0\t0.0\t0.0\t0\t0\t{g}\n"
                   for t, r, g in zip(starts, rows, spans))
    path = tmp_path / "steps.tsv.gz"
    with gzip.open(path, "wt") as f:
        f.write(step_trace.HEADER + body)
    steps = step_trace.read(str(path))
    line, gpu = step_trace.decode_by_rows(step_trace.with_periods(steps))
    assert "fit 5.00 ms + 50.0 us a row" in line and "gpu span: fit 4.00 ms + 40.0 us a row" in gpu
    assert "0-7: " in line and "40-47: " in line
    assert line in step_trace.summary(steps) and gpu in step_trace.summary(steps)
    assert step_trace.decode_by_rows([]) == []
    old = tmp_path / "old.tsv"   # before the span column: no span line
    old.write_text(step_trace.GPU_HEADER + "".join(b.rsplit("\t", 1)[0] + "\n" for b in body.splitlines()))
    assert len(step_trace.decode_by_rows(step_trace.with_periods(step_trace.read(str(old))))) == 1


def test_an_untimed_step_has_no_device_span():
    import math

    from kvserve.runner.model_runner import InFlightStep
    assert math.isnan(InFlightStep([], None).gpu_ms())


def test_the_step_trace_reader_names_a_bad_file_and_line(tmp_path, capsys):
    from kvserve.engine import step_trace
    other = tmp_path / "other.json"
    other.write_text('{"summary": {}}\n')
    assert step_trace.main([str(other)]) == 1
    assert "is not a step trace" in capsys.readouterr().out
    cut = tmp_path / "cut.tsv"
    cut.write_text(step_trace.HEADER + "1.0\t5.0\t4.0\t0.1\t8\t0\t0\t0.0\t0.0\t0\t0\tnan\n2.0\t5.0\n")
    assert step_trace.main([str(cut)]) == 1
    assert "line 3: 2 fields, expected 12" in capsys.readouterr().out


def test_the_step_trace_times_garbage_collection_and_names_the_longest_host_steps(tmp_path):
    """gc_ms: a collection inside a step is charged to that step's line, and only to it;
    traces from before the column read as NaN; the summary lists the host stalls."""
    import gc

    from kvserve.engine import step_trace
    clock = step_trace.GcClock()
    gc.collect()
    assert clock.take_ms() > 0 and clock.take_ms() == 0
    clock.close()
    gc.collect()
    assert clock.take_ms() == 0   # closed: no longer counting
    old = tmp_path / "old.tsv"
    old.write_text(step_trace.OLD_HEADER + "".join(f"{t / 1e3}\t5.0\t4.0\t0.1\t8\t0\t0\n" for t in range(0, 60, 6)))
    steps = step_trace.read(str(old))
    assert all(s["gc_ms"] != s["gc_ms"] and s["jit_ms"] != s["jit_ms"] for s in steps)   # NaN: not traced
    steps[3].update(step_ms=300.0, wait_ms=0.0, gc_ms=250.0, jit_ms=0.0)
    steps[5].update(step_ms=200.0, wait_ms=0.0)
    text = step_trace.summary(steps)
    assert ("longest host ms: 300.0 at 0.02 s (decode/graph, 0 prompt, device idle not traced, gc 250.0, jit 0.0, "
            "allocs not traced, flushes not traced), 200.0 at 0.03 s (decode/graph, 0 prompt, device idle not traced, "
            "gc not traced, jit not traced, allocs not traced, flushes not traced)") in text


def _timed_lines(lines: list[tuple[float, float, float]]) -> list[dict[str, float]]:
    """Trace lines from (host_ms, wait_ms, gpu_ms of the step it launched), as the core writes them:
    each line starts when the one before ends, and records the step before's device span."""
    steps, start, prev_gpu = [], 0.0, math.nan
    for host, wait, gpu in lines:
        steps.append({"start_s": start / 1e3, "step_ms": host + wait, "wait_ms": wait, "out_ms": 0.0, "rows": 8,
                      "prompt_tokens": 0, "eager": 0, "gc_ms": 0.0, "jit_ms": 0.0, "dev_allocs": 0,
                      "alloc_syncs": 0, "prev_gpu_ms": prev_gpu})
        start, prev_gpu = start + host + wait, gpu
    return steps


def test_the_longest_host_steps_say_what_they_cost_the_device():
    """A launch that stalls while the device has finished the step before (here 100 ms of host
    against a 6 ms step) leaves the device idle for the difference; one that blocks while the
    device still runs the step before (a full launch queue behind a 180 ms step: the wait then
    reads ~0) costs it nothing. The summary's longest host steps say which."""
    from kvserve.engine import step_trace
    # (host, wait, gpu) per line; a line's wait is for the step the line before launched.
    steady = [(1.0, 5.0, 6.0)] * 4
    stalled = [(100.0, 0.0, 6.0), (1.0, 5.0, 6.0)]            # 100 ms launch after a 6 ms step: 94 idle
    long_step = [(1.0, 5.0, 180.0), (180.0, 0.0, 6.0), (1.0, 4.0, 6.0)]   # blocks while the 180 ms step runs
    steps = _timed_lines(steady + stalled + steady + long_step + steady)
    rows = {round(s["host_ms"]): s for s in step_trace.with_periods(steps)}
    assert rows[100]["idle_before_ms"] == pytest.approx(94.0)
    assert rows[180]["idle_before_ms"] == pytest.approx(0.0)
    text = step_trace.summary(steps)
    assert "longest host ms: 180.0 at 0.16 s (decode/graph, 0 prompt, device idle 0.0, gc 0.0" in text
    assert "100.0 at 0.02 s (decode/graph, 0 prompt, device idle 94.0, gc 0.0" in text


def test_the_step_trace_counts_the_allocators_device_calls_per_step(tmp_path, monkeypatch):
    """dev_allocs / alloc_syncs: the counters' growth over each step, charged to that step alone;
    NaN without CUDA; a trace from before the columns reads them as NaN and its gc column stays."""
    from kvserve.engine import step_trace
    counters = {"num_device_alloc": 3, "num_device_free": 1, "num_alloc_retries": 0, "num_sync_all_streams": 2}
    monkeypatch.setattr(step_trace.AllocCounter, "__init__", lambda self: None)
    counter = step_trace.AllocCounter()
    counter._stats, counter._last = (lambda: dict(counters)), (4, 2)
    assert counter.take() == (0.0, 0.0)
    counters.update(num_device_alloc=5, num_device_free=2, num_alloc_retries=1)
    assert counter.take() == (3.0, 1.0) and counter.take() == (0.0, 0.0)
    counter._stats = None
    assert all(v != v for v in counter.take())
    before = tmp_path / "before.tsv"
    before.write_text(step_trace.ALLOC_HEADER + "1.0\t5.0\t4.0\t0.1\t8\t0\t0\t2.5\t0.0\n")
    (step,) = step_trace.read(str(before))
    assert step["gc_ms"] == 2.5 and step["dev_allocs"] != step["dev_allocs"]


def test_the_step_trace_times_triton_compiles_and_keeps_other_hooks(monkeypatch, caplog):
    """jit_ms: Triton's hooks before and after a compile time it; a slow one is logged by name;
    a hook installed before keeps being called (its result too: a true one skips the compile);
    closing restores it."""
    import time
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from triton import knobs

    from kvserve.engine import step_trace
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **info: seen.append(info["key"]) or None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(step_trace, "SLOW_JIT_MS", 5.0)
    before = knobs.runtime.jit_cache_hook
    clock = step_trace.JitClock()
    info = dict(repr="", fn=SimpleNamespace(name="_decode_split_kernel"), compile={}, is_manual_warmup=False,
                already_compiled=False)
    assert knobs.runtime.jit_cache_hook(key="k1", **info) is None and seen == ["k1"]
    time.sleep(0.01)
    knobs.runtime.jit_post_compile_hook(key="k1", **info)
    assert clock.take_ms() >= 10 and clock.take_ms() == 0
    assert "_decode_split_kernel in" in caplog.text
    clock.close()
    assert knobs.runtime.jit_cache_hook is before and knobs.runtime.jit_post_compile_hook is None


def test_a_compile_variant_names_its_constexprs_and_attributes_where_the_hook_gives_them():
    """Triton 3.6's `repr` names only a kernel's first argument: the variant adds the constexprs and
    specialised attributes, which tell two builds apart (the second `seq_idx_ptr` unaligned here)."""
    from kvserve.engine.step_trace import build_variant
    info = dict(repr="_top_k_kernel[num_warps=8](scores_ptr: ()", compile={
        "constants": {(9,): 4, (10,): 4096}, "configs": [{(4,): [], (5,): [["tt.divisibility", 16]]}]})
    assert build_variant(info) == ("_top_k_kernel[num_warps=8](scores_ptr: () constants={(9,): 4, (10,): 4096} "
                                   "attrs=[{(4,): [], (5,): [['tt.divisibility', 16]]}]")
    assert build_variant(dict(repr="[i32]", compile={})) == "[i32]"


def test_a_slow_compile_is_written_beside_the_trace_with_its_step(monkeypatch, tmp_path, capsys):
    """FILE.jit: a compile over SLOW_JIT_MS, with its step's start, kernel, ms and variant (on one
    line), and nothing for a step without one or a fast one; a new trace at the same path drops
    an earlier one's; the trace's summary prints it."""
    import time
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from triton import knobs

    from kvserve.engine import step_trace
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    # 50 ms: a busy 2-core CI machine has timed the "fast" compile below (no sleep) at 5.1 ms
    monkeypatch.setattr(step_trace, "SLOW_JIT_MS", 50.0)
    path = str(tmp_path / "steps.tsv")
    (tmp_path / "steps.tsv.jit").write_text("stale\n")
    trace = step_trace.StepTrace(path)
    assert not (tmp_path / "steps.tsv.jit").exists()
    engine = SimpleNamespace(_in_flight=None, runner=SimpleNamespace(num_eager_forwards=0), last_gpu_ms=0.0)

    def compile_(key, name, seconds):
        info = dict(key=key, repr="[i32, 'D']\n  LISTED=True", fn=SimpleNamespace(name=name), compile={},
                    is_manual_warmup=False, already_compiled=False)
        knobs.runtime.jit_cache_hook(**info)
        time.sleep(seconds)
        knobs.runtime.jit_post_compile_hook(**info)

    trace.record(1.0, 0.001, 0.0, 0.0, engine)
    compile_("k1", "_prefill_gluon_kernel", 0.2)
    compile_("k2", "_fast_kernel", 0.0)
    trace.record(2.0, 0.21, 0.0, 0.0, engine)
    trace.close()
    lines = step_trace.slow_compiles(path)
    assert len(lines) == 1
    start, kernel, ms, variant = lines[0].split("\t")
    assert (start, kernel, variant) == ("2.000000", "_prefill_gluon_kernel", "[i32, 'D'] LISTED=True")
    assert float(ms) >= 200
    assert step_trace.main([path]) == 0
    assert "2.000000\t_prefill_gluon_kernel" in capsys.readouterr().out


def test_the_sync_check_is_opt_in_and_needs_cuda(monkeypatch):
    import torch

    from kvserve.engine import step_trace
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(step_trace.SYNC_CHECK_ENV, raising=False)
    assert not step_trace.enable_sync_check_from_env()
    monkeypatch.setenv(step_trace.SYNC_CHECK_ENV, "1")
    assert step_trace.enable_sync_check_from_env() and modes == ["warn"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not step_trace.enable_sync_check_from_env() and modes == ["warn"]
    monkeypatch.setenv(step_trace.SYNC_CHECK_ENV, "yes")
    with pytest.raises(ValueError, match="KVSERVE_SYNC_CHECK must be 0 or 1, got 'yes'"):
        step_trace.enable_sync_check_from_env()
