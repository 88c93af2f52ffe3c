"""Engine behaviour beyond parity: prefix caching, sliding-window memory,
metrics, sampling controls and clear errors for bad input."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from kvserve import LLM, SamplingParams
from tests.tiny_models import random_prompts, save_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama") / "ckpt")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8, max_model_len=512)


def _gen(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_shared_prefix_reports_cached_tokens(llm):
    prefix = random_prompts([70], seed=11)[0]
    _gen(llm, [prefix + [5, 6, 7]])
    out = _gen(llm, [prefix + [9, 9]])[0]
    assert out.num_cached_tokens >= (len(prefix) // 8) * 8


def test_multi_turn_hits_previous_turn(llm):
    """Each turn resends the whole history; it must hit >= 90% of the previous
    turn's tokens (its prompt and its output)."""
    history = random_prompts([100], seed=12)[0]
    before = llm.get_metrics()["prefix_cache_hits"]
    hits = 0
    for turn in range(4):
        out = _gen(llm, [history])[0]
        if turn:
            assert out.num_cached_tokens >= 0.9 * previous_turn_tokens
            hits += out.num_cached_tokens
        previous_turn_tokens = len(history) + len(out.outputs[0].token_ids)
        history = history + out.outputs[0].token_ids + random_prompts([12], seed=20 + turn)[0]
    assert hits > 0
    assert llm.get_metrics()["prefix_cache_hits"] - before == hits


def test_metrics_stay_exact_across_generate_calls(llm):
    start = llm.get_metrics()
    prompts = random_prompts([20, 33], seed=13)
    queries = 0
    for _ in range(3):
        outs = _gen(llm, prompts)
        queries += sum(len(o.prompt_token_ids) for o in outs)
    end = llm.get_metrics()
    assert end["prefix_cache_queries"] - start["prefix_cache_queries"] == queries
    assert end["num_generation_tokens"] - start["num_generation_tokens"] == 3 * 2 * GREEDY.max_tokens
    assert end["num_requests_running"] == end["num_requests_waiting"] == 0
    assert end["kv_cache_usage_perc"] == 0.0 and end["kv_cache_fragmentation"] == 0.0


def test_sliding_window_blocks_stay_bounded(tmp_path):
    path = save_tiny_checkpoint("mistral", tmp_path / "mistral")  # sliding_window=8 on every layer
    window, block_size = 8, 4
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=block_size)
    engine = llm.engine
    request = engine.make_request(random_prompts([30], seed=3)[0],
                                  SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
    engine.add_request(request)
    bound = math.ceil(window / block_size) + 2
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        if not request.is_finished:
            held = [b for g in engine.kv_cache.get_block_ids(request.request_id) for b in g if b != 0]
            peak = max(peak, len(held))
            if request.num_output_tokens > 1:  # after a decode step (prefill held the prompt chunk)
                assert len(held) <= bound
    assert request.num_output_tokens == 150 and 0 < peak
    assert engine.kv_cache.usage == 0.0


def test_sink_tokens_keep_blocks(tmp_path):
    path = save_tiny_checkpoint("mistral", tmp_path / "mistral")
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4,
              hf_overrides={"attention_sink_size": 8})
    engine = llm.engine
    assert all(g.spec.describe() == "sliding(window=8, sink=8)" for g in engine.kv_cache.groups)
    request = engine.make_request(random_prompts([30], seed=3)[0],
                                  SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
        if not request.is_finished and request.num_output_tokens > 1:
            table = engine.kv_cache.get_block_ids(request.request_id)[0]
            assert table[0] != 0 and table[1] != 0  # sink blocks held
            assert len([b for b in table if b != 0]) <= 2 + math.ceil(8 / 4) + 2


def test_seeded_sampling_is_reproducible(llm):
    prompts = random_prompts([10, 12], seed=14)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in _gen(llm, prompts, params)]
    b = [o.outputs[0].token_ids for o in _gen(llm, prompts[::-1], params)][::-1]
    assert a == b
    c = [o.outputs[0].token_ids for o in _gen(llm, prompts, SamplingParams(
        temperature=1.0, max_tokens=12, seed=99, ignore_eos=True))]
    assert c != a


def test_logprobs_and_stop_token_ids(llm):
    prompt = random_prompts([15], seed=15)
    out = _gen(llm, prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 6
    assert all(comp.token_ids[i] in comp.logprobs[i] for i in range(6))
    assert comp.cumulative_logprob == pytest.approx(sum(comp.logprobs[i][comp.token_ids[i]] for i in range(6)))
    stop_at = comp.token_ids[2]
    stopped = _gen(llm, prompt, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_at],
                                               ignore_eos=True))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_at
    assert len(stopped.token_ids) == comp.token_ids.index(stop_at) + 1
    assert comp.finish_reason == "length"


def test_outputs_in_input_order_with_metrics(llm):
    prompts = random_prompts([40, 3, 25], seed=16)
    outs = _gen(llm, prompts)
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time


@pytest.mark.parametrize("prompt,params,match", [
    ("", GREEDY, "prompt must not be empty"),
    ({"prompt_token_ids": []}, GREEDY, "must not be empty"),
    ({"prompt_token_ids": [1] * 600}, GREEDY, "exceeds max_model_len=512"),
    ({"prompt_token_ids": [1] * 500}, SamplingParams(max_tokens=20), r"500 tokens\) \+ max_tokens \(20\)"),
    ({"prompt_token_ids": [1, 99999]}, GREEDY, "outside the vocabulary"),
])
def test_bad_requests_raise_clear_errors(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert llm.get_metrics()["num_requests_waiting"] == 0


def test_array_prompts_are_plain_ints(llm):
    """Token ids in a numpy array or a tensor are taken as the list of the same ints (the
    request echoes Python ints); non-integer ids are still refused."""
    import numpy as np
    ids = random_prompts([12], seed=9)[0]
    want = _gen(llm, [ids])[0]
    for array in (np.array(ids, dtype=np.int64), torch.tensor(ids)):
        got = _gen(llm, [array])[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.prompt_token_ids == ids and all(type(t) is int for t in got.prompt_token_ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _gen(llm, [[float(t) for t in ids]])


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_pool_smaller_than_one_request(llama_dir):
    with pytest.raises(ValueError, match="max_model_len=512 needs 64 KV blocks per request but the cache holds 3"):
        LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8, num_kv_blocks=4)


def test_missing_model_and_unsupported_architecture(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    save_file({"wte.weight": torch.zeros(10, 4)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(bad))


def test_bad_engine_knobs(llama_dir):
    with pytest.raises(ValueError, match="block_size must be between 1 and 256, got 512"):
        LLM(str(llama_dir), block_size=512)
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds"):
        LLM(str(llama_dir), max_model_len=4096)


def test_embedded_model_knows_paris():
    llm = LLM()
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_default_token_budget_follows_vllm():
    from kvserve.config import EngineArgs, default_token_budget
    h200, a100 = 143 * 2**30, 80 * 2**30
    assert default_token_budget("llm", h200, "NVIDIA H200") == 16384
    assert default_token_budget("server", h200, "NVIDIA H200") == 8192
    assert default_token_budget("llm", a100, "NVIDIA A100-SXM4-80GB") == 8192
    assert default_token_budget("llm", 24 * 2**30, "NVIDIA L4") == 8192
    assert default_token_budget("llm", 0) == 8192  # CPU
    assert EngineArgs().scheduler_config(4096, h200, "NVIDIA H200").max_num_batched_tokens == 16384
    assert EngineArgs(max_num_batched_tokens=512).scheduler_config(4096, h200).max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="usage must be one of llm, server, got 'batch'"):
        EngineArgs(usage="batch")


def test_cache_salt_keeps_prefixes_apart(llm):
    """vLLM's `cache_salt` in a prompt dict: a prompt cached under one salt is a hit for
    the same salt only, not for another salt or none; a salt must be a non-empty string."""
    prompt = random_prompts([64], seed=31)[0]

    def cached(**salt):
        return llm.generate([{"prompt_token_ids": prompt + [5], **salt}], GREEDY, use_tqdm=False)[0].num_cached_tokens
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    assert cached(cache_salt="tenant-a") == 64 and cached(cache_salt="tenant-b") == 64 and cached() == 64
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            cached(cache_salt=bad)


def test_unknown_prompt_dict_keys_are_refused(llm):
    with pytest.raises(ValueError, match=r"\['multi_modal_data'\] are not supported"):
        llm.generate([{"prompt_token_ids": [1, 2, 3], "multi_modal_data": {}}], GREEDY, use_tqdm=False)
