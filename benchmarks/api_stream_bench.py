"""The API server process's CPU per streamed token, without a model or a socket.

The real app (`build_app`: routes, middleware, AsyncEngine, output processing,
detokenization, SSE) serves C concurrent streaming /v1/completions requests
(token-id prompts, max_tokens T, ignore_eos) called in-process through ASGI. A
synthetic engine core answers them: every step it sends one CoreOutputs message
(msgpack-encoded and decoded as the real client does) with one new token for each
running request, as the engine core process would, on a fixed schedule (steps that
fell due while the event loop was busy arrive back to back). The host's CPU time over
the tokens streamed is the API side's cost per token; SSE events per token below 1
mean readers got several tokens a delta. With `--profile` a cProfile follows.

At 80 req/s the served ide-completion run (H200 host, 2026-12-01) streamed ~4.4K
tokens/s while the core made ~8K: the API process set the pace.

    python benchmarks/api_stream_bench.py TOKENIZER_DIR [--concurrency 64] [--tokens 100] [--profile]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pickle
import pstats
import random
import time
from types import SimpleNamespace

from kvserve.engine.core_process import CoreInfo
from kvserve.engine.core_protocol import Codec, CoreInputs, CoreOutput, CoreOutputs


class SyntheticCore:
    """Accepts every job, then emits one token per running request per step."""

    def __init__(self, tokenizer, step_s: float, seed: int = 0) -> None:
        config = SimpleNamespace(max_model_len=8192, max_num_seqs=1024)
        self.info = CoreInfo(tokenizer, config, SimpleNamespace(vocab_size=len(tokenizer)), frozenset(), {})
        self.step_s = step_s
        self._codec, self._encoder = Codec(CoreOutputs), Codec(CoreInputs)
        self._accepted: list[str] = []
        self._running: dict[str, list[int]] = {}   # request id -> [tokens sent, max tokens]
        self._rng = random.Random(seed)
        self._task: asyncio.Task | None = None
        self.tokens = 0

    def start(self, on_outputs, on_exit) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(on_outputs))

    def send(self, inputs: CoreInputs) -> None:
        for job in inputs.adds:
            self._accepted.append(job.job_id)
            for r in job.requests:
                self._running[r.request_id] = [0, pickle.loads(r.sampling_params).max_tokens]
        for request_id in inputs.aborts:
            self._running.pop(request_id, None)

    async def _run(self, on_outputs) -> None:
        """Steps on a fixed schedule, as the core process runs whatever the API side does:
        steps that fell due while the event loop was busy are delivered back to back, as
        the messages queued in the socket would be."""
        due = time.perf_counter() + self.step_s
        while True:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            while due <= time.perf_counter():   # each step that fell due, once
                on_outputs(self._codec.decode(self._codec.encode(self._step())))
                due += self.step_s

    def _step(self) -> CoreOutputs:
        message = CoreOutputs(accepted=self._accepted)
        self._accepted = []
        for request_id, state in list(self._running.items()):
            token = [self._rng.randrange(1000, 20000)]
            state[0] += 1
            self.tokens += 1
            if state[0] == 1:
                message.outputs.append(CoreOutput(request_id, token, num_cached_tokens=16,
                                                  scheduled_time=time.monotonic()))
            elif state[0] >= state[1]:
                message.outputs.append(CoreOutput(request_id, token, finish_reason="length"))
                del self._running[request_id]
            else:
                message.next_ids.append(request_id)
                message.next_tokens.append(token)
        return message

    @property
    def is_alive(self) -> bool:
        return True

    async def debug_snapshot(self, timeout_s: float):
        return {}

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def stream_one(app, body: bytes) -> int:
    """POST /v1/completions through ASGI; returns the SSE events received."""
    events, sent = 0, False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal events
        if message["type"] == "http.response.body":
            events += message.get("body", b"").count(b"data: ")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("bench", 80),
             "client": ("bench", 1), "root_path": "", "app": app}
    await app(scope, receive, send)
    return events


async def run(args, core: SyntheticCore, app) -> tuple[float, float, int, int]:
    body = json.dumps({"model": "m", "prompt": list(range(100, 100 + args.prompt_len)), "stream": True,
                       "max_tokens": args.tokens, "ignore_eos": True}).encode()
    async with app.router.lifespan_context(app):
        wall, cpu = time.perf_counter(), time.process_time()
        queue, events = asyncio.Queue(), 0
        for _ in range(args.requests):
            queue.put_nowait(body)

        async def worker():
            nonlocal events
            while not queue.empty():
                received = await stream_one(app, queue.get_nowait())
                events += received   # not `events += await ...`: that reads events before awaiting
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return time.perf_counter() - wall, time.process_time() - cpu, core.tokens, events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokenizer", help="a directory with a Hugging Face tokenizer")
    p.add_argument("--concurrency", type=int, default=64, help="streams open at once")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=100, help="max_tokens of each request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=5.0, help="the synthetic core's step period")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    for name in ("concurrency", "requests", "tokens", "prompt_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.step_ms <= 0:
        p.error(f"--step-ms must be above 0, got {args.step_ms}")
    from transformers import AutoTokenizer
    import kvserve.server.async_engine as async_engine
    from kvserve.server.app import build_app
    core = SyntheticCore(AutoTokenizer.from_pretrained(args.tokenizer), args.step_ms / 1e3)
    async_engine._make_core = lambda engine, hook: core   # the app's engine core is the synthetic one
    app = build_app(None, "m")
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    wall, cpu, tokens, events = asyncio.run(run(args, core, app))
    if profiler:
        profiler.disable()
    print(f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.0f} tokens/s), API-side CPU {cpu / tokens * 1e6:.1f} "
          f"us/token ({cpu / wall:.0%} of one core), {events / tokens:.2f} SSE events a token")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
