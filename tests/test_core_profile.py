"""POST /start_profile and /stop_profile (vLLM's routes): with KVSERVE_TORCH_PROFILER_DIR set,
the engine core records the steps between them under torch.profiler and writes a Chrome trace
and an op table; without it the routes do not exist; a command out of order is a 400."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from kvserve.engine.device_profile import ENV  # noqa: E402

MODEL = "dummy:tiny-llama"


def _client():
    from fastapi.testclient import TestClient

    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.server.app import build_app
    engine = LLMEngine(EngineArgs(model=MODEL, load_format="dummy", device="cpu", dtype="float32",
                                  block_size=8, max_model_len=256, num_kv_blocks=100))
    return TestClient(build_app(engine, "tiny"))


def _complete(client, max_tokens: int) -> dict:
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8],
                                                     "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_profile_records_the_steps_between_start_and_stop(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "profiles"))
    with _client() as client:
        _complete(client, 3)                        # before the start: not recorded
        started = client.post("/start_profile")
        assert started.status_code == 200 and started.json()["status"] == "started"
        again = client.post("/start_profile")
        assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
        _complete(client, 6)
        stopped = client.post("/stop_profile")
        assert stopped.status_code == 200, stopped.text
        body = stopped.json()
        late = client.post("/stop_profile")
        assert late.status_code == 400 and "no profile is running" in late.json()["error"]["message"]
    assert body["status"] == "stopped"
    assert 6 <= body["steps"] <= 7                   # the 6-token request's steps, not the first one's
    trace = json.loads(open(body["trace"]).read())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert names & {"aten::mm", "aten::addmm"}      # the model's matrix products were recorded
    table = open(body["table"]).read()
    assert "Self CPU" in table and len(table.splitlines()) > 5
    assert {p.name for p in (tmp_path / "profiles").iterdir()} == {body["trace"].split("/")[-1],
                                                                   body["table"].split("/")[-1]}


def test_without_the_directory_the_routes_do_not_exist(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with _client() as client:
        assert client.post("/start_profile").status_code == 404
        assert client.post("/stop_profile").status_code == 404
        _complete(client, 2)                         # the server is otherwise unchanged


def test_a_failing_profiler_fails_the_command_not_the_server(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(ENV, str(blocker))            # the profile directory cannot be made
    with _client() as client:
        response = client.post("/start_profile")
        assert response.status_code == 400 and "the profiler failed" in response.json()["error"]["message"]
        assert _complete(client, 3)["usage"]["completion_tokens"] == 3
        assert client.get("/health").status_code == 200


def test_queries_waiting_when_the_core_stops_fail_at_once():
    """A debug or profile query in flight when the core exits gets the exit's reason, not its
    timeout (the route answers 503 at once)."""
    import asyncio

    from kvserve.engine.core_client import DebugQueries

    async def scenario():
        queries, exits = DebugQueries(), []
        on_exit = queries.failing(exits.append)
        asking = asyncio.ensure_future(queries.ask(lambda inputs: None, timeout_s=60))
        await asyncio.sleep(0)
        on_exit("the engine core process exited with code 1")
        with pytest.raises(RuntimeError, match="exited with code 1"):
            await asyncio.wait_for(asking, 5)
        assert exits == ["the engine core process exited with code 1"]
    asyncio.run(scenario())
