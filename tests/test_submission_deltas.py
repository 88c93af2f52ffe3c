"""How a submission's deltas follow its tokens (server/async_engine.py).

A reader that keeps up gets one delta per token; one that falls behind gets one
delta for every token that arrived meanwhile, its text the same as token by
token; a choice that finished while queued sends nothing more than its final
delta (which, cut at a stop string, must not be followed by the text after it).
The engine core is a stand-in: the test hands AsyncEngine its step messages.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("msgspec")

from kvserve.engine.core_process import CoreInfo  # noqa: E402
from kvserve.engine.core_protocol import CoreInputs, CoreOutput, CoreOutputs  # noqa: E402
from kvserve.server import async_engine  # noqa: E402
from kvserve.server.async_engine import AsyncEngine, Job  # noqa: E402
from tests.test_detokenizer import _byte_level  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. Hello, world!"


class StandInCore:
    def __init__(self, tokenizer) -> None:
        self.info = CoreInfo(tokenizer, SimpleNamespace(max_model_len=1024, max_num_seqs=8),
                             SimpleNamespace(vocab_size=len(tokenizer)), frozenset(), {})
        self.inputs: list[CoreInputs] = []
        self.is_alive = True

    def start(self, on_outputs, on_exit) -> None:
        pass

    def send(self, inputs: CoreInputs) -> None:
        self.inputs.append(inputs)

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return _byte_level()


async def _submitted(monkeypatch, tokenizer, **params):
    core = StandInCore(tokenizer)
    monkeypatch.setattr(async_engine, "_make_core", lambda engine, hook: core)
    engine = AsyncEngine(None)
    engine.start()
    submitting = asyncio.ensure_future(engine.submit(Job([[1, 2, 3]], {"ignore_eos": True, **params}, 64)))
    await asyncio.sleep(0)
    await asyncio.sleep(0)   # the add leaves at the end of the loop turn
    job_id = core.inputs[-1].adds[0].job_id
    engine._on_outputs(CoreOutputs(accepted=[job_id]))
    sub, _ = await submitting
    return engine, sub, sub.choices[0].request_id


def _step(engine, request_id, token, first=False, finish=None):
    if first or finish:
        engine._on_outputs(CoreOutputs(outputs=[CoreOutput(request_id, [token], finish_reason=finish,
                                                           num_cached_tokens=1 if first else 0)]))
    else:
        engine._on_outputs(CoreOutputs(next_ids=[request_id], next_tokens=[[token]]))


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_reader_that_keeps_up_gets_a_delta_per_token(monkeypatch, tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)

    async def run():
        engine, sub, rid = await _submitted(monkeypatch, tokenizer)
        deltas = engine.deltas(sub)
        got = []
        for i, token in enumerate(ids):
            _step(engine, rid, token, first=i == 0, finish="length" if i == len(ids) - 1 else None)
            got.append(await deltas.__anext__())
        return got
    got = _run(run())
    assert [d.token_ids for d in got] == [[t] for t in ids]
    assert "".join(d.text for d in got) == tokenizer.decode(ids, skip_special_tokens=True)
    assert got[-1].finish_reason == "length"


def test_a_lagging_reader_gets_the_tokens_that_arrived_meanwhile_in_one_delta(monkeypatch, tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)

    async def run():
        engine, sub, rid = await _submitted(monkeypatch, tokenizer)
        deltas = engine.deltas(sub)
        for i, token in enumerate(ids[:5]):          # five steps before the reader runs
            _step(engine, rid, token, first=i == 0)
        first = await deltas.__anext__()
        for token in ids[5:-1]:
            _step(engine, rid, token)
        _step(engine, rid, ids[-1], finish="length")  # finished before the reader took the rest
        rest = [d async for d in deltas]
        return first, rest
    first, rest = _run(run())
    assert first.token_ids == ids[:5] and first.finish_reason is None
    assert len(rest) == 1 and rest[0].token_ids == ids[5:] and rest[0].finish_reason == "length"
    assert first.text + rest[0].text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_choice_cut_at_a_stop_string_while_queued_sends_no_text_past_it(monkeypatch, tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)

    async def run():
        engine, sub, rid = await _submitted(monkeypatch, tokenizer, stop=["fox"])
        for i, token in enumerate(ids):   # the stop string completes mid-way; the reader has not run
            _step(engine, rid, token, first=i == 0)
        return [d async for d in engine.deltas(sub)], engine
    got, engine = _run(run())
    assert "".join(d.text for d in got) == "The quick brown "
    assert got[-1].finish_reason == "stop" and got[-1].stop_reason == "fox"
    request_id = engine.core.inputs[0].adds[0].requests[0].request_id
    assert request_id in [a for inputs in engine.core.inputs for a in inputs.aborts]   # the core cannot see text

