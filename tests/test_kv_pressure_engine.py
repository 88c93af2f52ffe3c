"""The host tier, swap and reuse-aware eviction through the whole engine (CPU,
tiny random Llama): greedy outputs never change, counters stay exact across
generate() calls, and the reuse policy beats LRU on a multi-turn workload."""
from __future__ import annotations

import random

import pytest

from kvserve.config import EngineArgs
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tiny_models import random_prompts, save_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=4, max_model_len=96, **kwargs)


def _run_twice(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Two generate() calls: the second one reloads evicted prefixes."""
    outs = []
    for _ in range(2):
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        outs += [r.outputs[0].token_ids for r in results]
    llm.engine.kv_cache.check_integrity()
    return outs


# Swap-ins load a step ahead (load-ahead admission). On CPU the runner holds a
# prefetch back until the next forward, the latest it may land: a forward that
# read it early would change the outputs (scheduling a load-ahead request in
# its own admission step fails all three swap-in cases below).
AHEAD = ("num_load_ahead_admissions", "kv_host_blocks_prefetched")


@pytest.mark.parametrize("kwargs, expect", [
    (dict(preemption_mode="swap", cpu_kv_cache_gb=0.001), ("kv_host_swap_ins", "kv_host_hit_tokens", *AHEAD)),
    (dict(preemption_mode="recompute", cpu_kv_cache_gb=0.0002, eviction_policy="reuse"),
     ("kv_host_hit_tokens", "kv_host_evictions")),
    (dict(preemption_mode="auto", cpu_kv_cache_gb=0.001, eviction_policy="reuse"), ("kv_host_swap_ins", *AHEAD)),
])
def test_greedy_outputs_identical_with_host_tier(llama, kwargs, expect):
    prompts = random_prompts([40, 55, 33, 60, 47, 38], seed=1)
    reference = _run_twice(_llm(llama), prompts)
    llm = _llm(llama, num_kv_blocks=30, **kwargs)
    assert _run_twice(llm, prompts) == reference
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    for key in expect:
        assert metrics[key] > 0, key
    assert metrics["num_requests_swapped"] == 0
    assert metrics["kv_host_swap_outs"] == metrics["kv_host_swap_ins"] + metrics["kv_host_swap_drops"]


def test_counters_exact_across_generate_calls(llama):
    # One request at a time, and B needs every usable block: B evicts all of A.
    llm = LLM(str(llama), dtype="float32", device="cpu", block_size=4, max_model_len=52,
              num_kv_blocks=14, max_num_seqs=1, cpu_kv_cache_gb=0.001)
    a, b = random_prompts([40, 44], seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine, host = llm.engine, llm.engine.kv_cache.host_tier
    block_bytes = host.block_bytes
    outputs, previous = [], None
    for call, prompt in enumerate([a, b, a, b, a]):
        outputs += llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        m = llm.get_metrics()
        if call == 2:  # all of A's 9 hittable blocks (39 tokens -> 36) came back from host
            assert m["kv_host_hit_tokens"] == 36 and outputs[-1].num_cached_tokens == 36
        assert m["prefix_cache_hits"] == sum(o.num_cached_tokens for o in outputs)
        assert m["kv_host_blocks_to_host"] == host.num_saves + host.num_write_backs + host.num_swap_out_blocks
        assert m["kv_host_blocks_to_gpu"] == host.num_loads == m["kv_host_hit_tokens"] // 4
        assert m["kv_host_bytes_to_host"] == m["kv_host_blocks_to_host"] * block_bytes
        assert m["kv_host_bytes_to_gpu"] == m["kv_host_blocks_to_gpu"] * block_bytes
        assert host.num_saves + host.num_save_dedups == m["kv_cache_evictions"]
        if previous is not None and call >= 2:
            assert m["kv_host_hit_tokens"] > previous["kv_host_hit_tokens"]
            assert m["kv_host_load_wait_s"] > previous["kv_host_load_wait_s"]
        previous = m
    assert engine.scheduler.num_preemptions == 0


def _multi_turn_hit_rate(path, policy: str, num_blocks: int) -> float:
    """8 conversations x 3 turns; turn k+1 re-sends turn k's prompt + 12 new tokens."""
    rng = random.Random(0)
    llm = _llm(path, num_kv_blocks=num_blocks, max_num_seqs=2, eviction_policy=policy)
    prompts = [[rng.randrange(3, 256) for _ in range(48)] for _ in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cached = total = 0
    for _ in range(3):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        cached += sum(o.num_cached_tokens for o in outs)
        total += sum(len(p) for p in prompts)
        prompts = [p + [rng.randrange(3, 256) for _ in range(12)] for p in prompts]
    return cached / total


def test_reuse_policy_beats_lru_on_multi_turn(llama):
    lru = _multi_turn_hit_rate(llama, "lru", 88)
    reuse = _multi_turn_hit_rate(llama, "reuse", 88)
    assert reuse > lru + 0.1, (lru, reuse)


def test_config_validation():
    with pytest.raises(ValueError, match="eviction_policy"):
        EngineArgs(eviction_policy="fifo")
    with pytest.raises(ValueError, match="cpu_kv_cache_gb"):
        EngineArgs(cpu_kv_cache_gb=-1)
    with pytest.raises(ValueError, match="needs a host KV tier"):
        EngineArgs(preemption_mode="swap")


@pytest.mark.parametrize("cpu_kv_cache_gb", [0.0, 0.001])
def test_kv_rotation_finishes_a_burst_in_fewer_steps(llama, cpu_kv_cache_gb):
    """Six equal requests, KV for about four: without rotation the last two
    decode alone in a second wave; rotating them in keeps the batch full.
    Greedy outputs stay those of a run with room for all."""
    prompts = random_prompts([40] * 6, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def run(**kwargs):
        llm = _llm(llama, cpu_kv_cache_gb=cpu_kv_cache_gb, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.engine.kv_cache.check_integrity()
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()

    reference, _ = run(num_kv_blocks=200)
    waves, m_waves = run(num_kv_blocks=85)
    rotated, m_rot = run(num_kv_blocks=85, kv_rotation_interval=4)
    assert waves == reference and rotated == reference
    assert m_waves["num_kv_rotations"] == 0 and m_rot["num_kv_rotations"] > 0
    assert m_rot["num_steps"] < 0.9 * m_waves["num_steps"]
    if cpu_kv_cache_gb:  # rotated-out requests come back through load-ahead swap-ins
        assert m_rot["num_load_ahead_admissions"] > 0 and m_rot["kv_host_blocks_prefetched"] > 0


def test_load_ahead_admission_waits_one_step(llama):
    """A swapped-out request re-admitted while another runs: its hit blocks are
    taken and their loads queued as the step's prefetch, but it is scheduled
    only from the next step on, with the loads already issued."""
    llm = _llm(llama, num_kv_blocks=40, cpu_kv_cache_gb=0.001, preemption_mode="swap")
    engine, scheduler = llm.engine, llm.engine.scheduler
    a, b = random_prompts([40, 31], seed=5)   # b's tail block is partial at the swap: private, to the host
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    req_a, req_b = engine.make_request(a, params), engine.make_request(b, params)
    for request in (req_a, req_b):
        engine.add_request(request)
    for _ in range(3):
        engine.step()
    scheduler.running.remove(req_b)
    scheduler._preempt(req_b)  # swapped out while A keeps running
    assert engine.kv_cache.get_computed_blocks(req_b)[0].num_host_blocks > 0
    outs, schedule = [], scheduler.schedule
    scheduler.schedule = lambda: outs.append(schedule()) or outs[-1]
    engine.step()
    out = outs[-1]
    assert [s.request for s in out.scheduled] == [req_a] and req_b in scheduler.running
    # The swap-out (queued before this step) is waited for; the loads are not.
    assert all(c.to_host for c in out.kv_copies.copies)
    assert any(not c.to_host for c in out.kv_prefetch.copies)
    assert scheduler.num_load_ahead == 1
    engine.step()
    assert [s.request.request_id for s in outs[-1].scheduled] == [req_a.request_id, req_b.request_id]
    assert not outs[-1].kv_prefetch.copies
    while engine.has_unfinished_requests():
        engine.step()
    reference = _llm(llama).generate([{"prompt_token_ids": p} for p in (a, b)], params, use_tqdm=False)
    assert [req_a.output_token_ids, req_b.output_token_ids] == [r.outputs[0].token_ids for r in reference]
