"""A non-streaming request whose client disconnects is aborted, through the
real server on a loopback port: the engine stops generating for it and every
KV block comes back. Waits poll a condition (no fixed sleeps decide a result)."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from kvserve.bench.serve import parse_prometheus
from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import build_app
from tests.tiny_models import save_tiny_checkpoint

ABORTED = 'kvserve:request_success_total{finished_reason="abort"}'
LENGTH = 'kvserve:request_success_total{finished_reason="length"}'


def wait_for(condition, what: str, timeout: float = 60.0, every: float = 0.02):
    """Poll `condition()` until it returns a truthy value; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return value


class Server:
    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(httpx.get(f"http://127.0.0.1:{self.port}/metrics").text)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-dc") / "llama",
                               max_position_embeddings=4096)
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", device="cpu", max_model_len=4096))
    with Server(build_app(engine, "tiny")) as live:
        yield live


def _post_raw(port: int, body: dict) -> socket.socket:
    """Send a POST and leave the response unread (the client may then vanish)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_non_streaming_disconnect_aborts_and_frees_the_kv(server):
    before = server.metrics()
    # 4000 tokens take the tiny model many seconds on CPU; the disconnect lands long before.
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True}
    sock = _post_raw(server.port, body)
    wait_for(lambda: server.metrics()["kvserve:num_requests_running"] == 1, "the request to run")
    assert server.metrics()["kvserve:kv_cache_usage_perc"] > 0
    sock.close()
    m = wait_for(lambda: (m := server.metrics())["kvserve:num_requests_running"] == 0 and m,
                 "the request to leave the engine")
    assert m[ABORTED] - before.get(ABORTED, 0) == 1
    assert m.get(LENGTH, 0) == before.get(LENGTH, 0), "the request ran to its length: not cancelled"
    assert m["kvserve:kv_cache_usage_perc"] == 0.0 and m["kvserve:num_requests_waiting"] == 0


def test_a_connected_client_still_gets_its_answer(server):
    """The disconnect check does not cancel a client that waits."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}
    reply = httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 40
    assert reply.json()["choices"][0]["finish_reason"] == "length"
