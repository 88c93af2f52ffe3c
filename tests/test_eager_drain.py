"""Long eager steps resolve the step in flight inside their launch, once their
first layers are queued (`LLMEngine._drain_before_long_launch`,
`ModelRunner.drain_after_layers`): on a GPU the whole launch fills the
device's launch queue, and the step before's tokens would wait behind it.
Their inputs are prepared before, as a pipelined step's are, and the device
runs the first layers while the host reads the tokens. On CPU the bound is set
by hand; the tokens must be those of the fully pipelined engine."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.tiny_models import random_prompts, save_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama") / "ckpt")


def _run(llama_dir, drain_above: int | None, stops: dict[int, list[int]], events: list | None = None):
    """Four short requests decode while two 300-token prompts are prefilled in 64-token
    steps. Returns (outputs, launches: (tokens, decode-only, previous given to `prepare`,
    the step before still in flight when `run` starts, the layers queued when `run`
    resolved it (None: it did not), row request indices)). With `events`, steps get an
    `emit` and the list gets, in order, ("prepare", tokens), ("launch", tokens) and
    ("launched", tokens) per step, ("emit", {index: tokens so far}) per emit and
    ("return", {index: tokens so far}) per step."""
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8, max_model_len=512,
              max_num_batched_tokens=64)
    engine = llm.engine
    engine.runner.drain_above_tokens = drain_above
    launches, runner = [], engine.runner
    prepare, run, given = runner.prepare, runner.run, []

    def spy_prepare(out, tables, previous=None):
        given.append(previous is not None)
        if events is not None:
            events.append(("prepare", out.num_tokens))
        return prepare(out, tables, previous)

    layers, drained_at = [], []
    for i, layer in enumerate(engine.runner.model.model.layers):
        layer.register_forward_hook(lambda *_, i=i: layers.append(i))

    def spy_drain(drain):
        drained_at.append(len(layers))
        drain()

    def spy_run(inputs, out, prompt_logprobs=None, drain=None):
        in_flight = engine._in_flight is not None
        layers.clear(), drained_at.clear()
        if events is not None:
            events.append(("launch", out.num_tokens))
        launched = run(inputs, out, prompt_logprobs, drain and (lambda: spy_drain(drain)))
        launches.append((out.num_tokens, out.decode is not None, given[-1], in_flight,
                         drained_at[0] if drained_at else None, {requests.index(s.request) for s in out.scheduled}))
        if events is not None:
            events.append(("launched", out.num_tokens))
        return launched
    runner.prepare, runner.run = spy_prepare, spy_run
    seen = lambda touched: {requests.index(r): len(r.output_token_ids) for r in touched}  # noqa: E731

    def step():
        if events is None:
            return engine.step()
        events.append(("return", seen(engine.step(emit=lambda touched: events.append(("emit", seen(touched)))))))
    requests = [engine.make_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop_token_ids=stops.get(i)))
                for i, p in enumerate(random_prompts([5, 7, 9, 11], seed=3))]
    for r in requests:
        engine.add_request(r)
    for _ in range(3):
        step()
    for p in random_prompts([300, 300], seed=4):
        request = engine.make_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        requests.append(request)
        engine.add_request(request)
    while engine.has_unfinished_requests():
        step()
    assert all(r.num_pending_tokens == 0 for r in requests)   # a drained stop leaves nothing pending
    return [list(r.output_token_ids) for r in requests], launches


def test_long_eager_steps_resolve_the_step_in_flight_after_their_first_layers(llama_dir):
    reference, _ = _run(llama_dir, None, {})
    # A short request stops at a token first sampled from its 5th on, while the long prompts are prefilled.
    i, k = next((i, k) for i in range(4) for k in range(4, 12) if reference[i][k] not in reference[i][:k])
    stops = {i: [reference[i][k]]}
    pipelined, plain = _run(llama_dir, None, stops)
    drained, launches = _run(llama_dir, 16, stops)
    assert drained == pipelined and drained[i] == reference[i][:k + 1]
    long_steps = [x for x in launches[1:] if x[0] > 16 and not x[1]]   # the first had no step before it
    # prepared with the step before in flight (its pending tokens gathered on the device), that step
    # resolved once the first two of the four layers were queued
    assert len(long_steps) >= 8
    assert all(given and in_flight and at == 2 for _, _, given, in_flight, at, _ in long_steps)
    assert all(in_flight and at is None for tokens, _, _, in_flight, at, _ in launches[1:] if tokens <= 16)  # pipelined
    assert all(in_flight and at is None for tokens, decode, _, in_flight, at, _ in plain[1:]
               if tokens > 16 and not decode)   # no drain
    # Prepared before the stop was read, a long step carries the stopped request's row, as the
    # pipelined engine's steps do; its token is dropped (the outputs above).
    rows_of = lambda launched: sum(i in rows for *_, rows in launched)  # noqa: E731
    assert rows_of(plain) == rows_of(launches)


def test_tokens_a_drain_read_go_out_before_the_long_launch(llama_dir):
    """With `emit` (the serving core's), a drained step's tokens are handed over inside the long
    launch, not after it; every token still reaches the caller, and the outputs do not change."""
    reference, _ = _run(llama_dir, 16, {})
    events = []
    outputs, _ = _run(llama_dir, 16, {}, events)
    assert outputs == reference
    # the long launches with a step in flight before them (the first, the short prompts', has none):
    # prepared, launched, the step before read and its tokens handed over, the launch finished
    long_launches = [i for i, (kind, tokens) in enumerate(events) if kind == "launch" and tokens > 16 and i > 1]
    assert len(long_launches) >= 8
    assert all(events[i + 1][0] == "emit" and events[i + 1][1] for i in long_launches)
    assert all(events[i - 1] == ("prepare", events[i][1]) and events[i + 2] == ("launched", events[i][1])
               for i in long_launches)
    emitted = [e for kind, e in events if kind == "emit"]
    assert all(e for e in emitted) and len(emitted) == len(long_launches)
    delivered = {}
    for kind, got in events:
        if kind in ("emit", "return"):
            for index, count in got.items():
                assert count > delivered.get(index, 0)   # each hand-over carries new tokens
                delivered[index] = count
    assert delivered == {i: len(out) for i, out in enumerate(outputs)}
