"""Long eager steps resolve the step in flight before they launch
(`LLMEngine._drain_before_long_launch`): on a GPU such a launch fills the
device's launch queue, and the step before's tokens would wait behind it.
On CPU the bound is set by hand; the tokens must be those of the fully
pipelined engine, and no launch may carry a request the drained step stopped."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.tiny_models import random_prompts, save_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama") / "ckpt")


def _run(llama_dir, drain_above: int | None, stops: dict[int, list[int]]):
    """Four short requests decode while two 300-token prompts are prefilled in 64-token
    steps. Returns (outputs, launches: (tokens, decode-only, previous given, row request indices))."""
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8, max_model_len=512,
              max_num_batched_tokens=64)
    engine = llm.engine
    engine.runner.drain_above_tokens = drain_above
    launches, launch = [], engine.runner.launch

    def spy(out, tables, previous=None, prompt_logprobs=None):
        assert not any(s.request.is_finished for s in out.scheduled)
        launches.append((out.num_tokens, out.decode is not None, previous is not None,
                         {requests.index(s.request) for s in out.scheduled}))
        return launch(out, tables, previous, prompt_logprobs)
    engine.runner.launch = spy
    requests = [engine.make_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop_token_ids=stops.get(i)))
                for i, p in enumerate(random_prompts([5, 7, 9, 11], seed=3))]
    for r in requests:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    for p in random_prompts([300, 300], seed=4):
        request = engine.make_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        requests.append(request)
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return [list(r.output_token_ids) for r in requests], launches


def test_long_eager_steps_launch_after_the_step_in_flight_is_resolved(llama_dir):
    reference, _ = _run(llama_dir, None, {})
    # A short request stops at a token first sampled from its 5th on, while the long prompts are prefilled.
    i, k = next((i, k) for i in range(4) for k in range(4, 12) if reference[i][k] not in reference[i][:k])
    stops = {i: [reference[i][k]]}
    pipelined, plain = _run(llama_dir, None, stops)
    drained, launches = _run(llama_dir, 16, stops)
    assert drained == pipelined and drained[i] == reference[i][:k + 1]
    long_steps = [x for x in launches if x[0] > 16 and not x[1]]
    assert len(long_steps) >= 8 and not any(previous for _, _, previous, _ in long_steps)
    assert any(previous for tokens, _, previous, _ in launches if tokens <= 16)   # short steps stay pipelined
    # The pipelined engine launched one more row of that request (after its stop token was
    # sampled, not yet read); the drained one read the stop first and left the row out.
    rows_of = lambda launched: sum(i in rows for *_, rows in launched)  # noqa: E731
    assert rows_of(plain) == rows_of(launches) + 1
