"""Tensor parallelism end to end on CPU (gloo, float32, one spawned worker):
greedy tokens with tensor_parallel_size=2 equal HF transformers' and the
single-rank engine's, for split KV heads and for one KV head replicated on
both ranks, with prefix caching on and off and prefill chunked by a small
token budget, and the worker exits when the engine closes; the same tokens
through `kvserve serve`'s engine-core process.

The CPU has 2 cores, so each case builds one two-rank engine on a tiny model.
"""
from __future__ import annotations

import multiprocessing

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from kvserve.server.app import build_app
from tests.test_server import LiveServer
from tests.tiny_models import hf_greedy, random_prompts, save_tiny_checkpoint

LENGTHS = [5, 17, 30]
NEW_TOKENS = 8
# (architecture, KV heads, prefix caching, max_num_batched_tokens)
CASES = [("llama", 2, True, 16), ("llama", 2, False, 24),
         ("qwen3", 1, True, 24), ("qwen3-hybrid", 1, False, 16)]


def _prompts() -> list[list[int]]:
    prompts = random_prompts(LENGTHS)
    return prompts + [prompts[2] + prompts[0], prompts[1]]  # shared prefixes: hits when caching is on


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _llm(path, tp: int, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=tp, **kwargs)


@pytest.mark.parametrize("kind,kv_heads,prefix_caching,budget", CASES)
def test_two_ranks_match_hf_and_one_rank(tmp_path, kind, kv_heads, prefix_caching, budget):
    path = save_tiny_checkpoint(kind, tmp_path / kind, num_key_value_heads=kv_heads)
    prompts = _prompts()
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    kwargs = dict(enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget, block_size=8)
    one = _llm(path, 1, **kwargs)
    assert _greedy(one, prompts) == expected
    llm = _llm(path, 2, **kwargs)
    driver = llm.engine.runner.step_channel
    try:
        assert llm.engine.runner.layout.num_kv_heads == 1  # this rank's share (or its replica)
        assert _greedy(llm, prompts) == expected
        assert (llm.get_metrics()["prefix_cache_hits"] > 0) == prefix_caching
        _assert_same_prompt_logprobs(one, llm, prompts[3])
    finally:
        driver.close()
    # Closing stops the worker: it leaves its step loop and exits cleanly.
    assert [p.exitcode for p in driver._workers.processes] == [0]


def test_a_driver_failure_after_spawning_stops_the_worker(tmp_path):
    """The driver alone checks that one request fits the KV cache, after the
    worker has started: the error is the driver's, and no worker is left."""
    path = save_tiny_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="max_model_len=128 needs .* KV blocks per request but the cache holds 2"):
        _llm(path, 2, num_kv_blocks=3, block_size=16)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("kvserve-tp-rank")]


def _assert_same_prompt_logprobs(one: LLM, two: LLM, prompt: list[int]) -> None:
    """Prompt logprobs compute logits of prompt rows beside the sampling rows:
    the workers must join those gathers too."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    a, b = (llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0] for llm in (one, two))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(a.prompt_logprobs) == len(prompt) and a.prompt_logprobs[0] is None
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank for t in x)


def test_served_core_process_runs_two_ranks(tmp_path):
    """`kvserve serve -tp 2`: the (daemonic) engine-core process spawns the worker."""
    path = save_tiny_checkpoint("llama", tmp_path / "llama")
    prompts = random_prompts([9, 23])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2,
                      usage="server")
    with LiveServer(build_app(args, "tiny")) as server:
        client = server.client()
        for prompt, want in zip(prompts, expected):
            # No tokenizer: logprobs name each token by its id.
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                            logprobs=0, extra_body={"ignore_eos": True})
            assert [int(t) for t in out.choices[0].logprobs.tokens] == want
