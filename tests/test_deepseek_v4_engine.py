"""DeepSeek V4 through the engine: per-group pages in the one block pool
(sliding K=V, compressor state, CSA entries + indexer keys, HCA entries),
chunked prefill that splits compression windows, prefix caching that restores
the compressor state, preemption by recompute. References: transformers'
generate (configs without indexer ties) and the float64 reference (with ties)."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from kvserve.entrypoints.llm import LLM
from kvserve.model.deepseek_v4.generate import greedy_generate
from kvserve.model.deepseek_v4.loader import load_deepseek_v4
from kvserve.sampling_params import SamplingParams
from tests.v4_reference import Reference
from tests.v4_tiny import CSA, HCA, SLIDING, one_thread, hf_greedy, tiny_v4_model  # noqa: F401 (one_thread: autouse)


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def _run(path, prompts, max_tokens, **engine_kwargs):
    llm = LLM(str(path), max_model_len=160, **engine_kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """CSA + HCA + sliding layers; 16 indexer heads so transformers' top-k has no ties."""
    path = tmp_path_factory.mktemp("v4mixed")
    hf = tiny_v4_model([CSA, HCA, SLIDING], index_n_heads=16)
    hf.save_pretrained(path)
    prompts = _prompts((1, 6, 23, 70))
    return path, prompts, [hf_greedy(hf, p, 24) for p in prompts]


def test_engine_matches_transformers_generate(mixed):
    path, prompts, expected = mixed
    got, llm = _run(path, prompts, 24, block_size=16, max_num_batched_tokens=13)
    assert got == expected
    metrics = llm.engine.get_metrics()
    assert metrics["num_requests_running"] == 0 and metrics["kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [5, 13])
def test_block_sizes_caching_and_chunks(mixed, block_size, caching, budget):
    path, prompts, expected = mixed
    shared = prompts[3][:40]  # two requests share 40 tokens: hits split compression windows
    got, llm = _run(path, [prompts[3], shared + prompts[2]], 8, block_size=block_size,
                    enable_prefix_caching=caching, max_num_batched_tokens=budget)
    assert got[0] == expected[3][:8]
    assert got[1] == greedy_generate(load_deepseek_v4(str(path)), [shared + prompts[2]], 8)[0]
    assert (llm.engine.get_metrics()["prefix_cache_hits"] > 0) == caching


@pytest.mark.parametrize("block_size", [8, 32])
def test_preemption_by_recompute(mixed, block_size):
    path, prompts, expected = mixed
    blocks = {8: 60, 32: 22}[block_size]
    got, llm = _run(path, prompts, 24, block_size=block_size, max_num_batched_tokens=13,
                    num_kv_blocks=blocks, max_num_seqs=4)
    assert llm.engine.get_metrics()["num_preemptions"] > 0
    assert got == expected


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("caching", [True, False])
def test_preemption_by_swap_through_the_host_tier(mixed, block_size, caching):
    """A small pool with a host tier and swap preemption: requests are swapped out to host
    pages and back in (V4's groups as one page a block; without prefix caching the whole
    computed KV, with it the part past the cached prefix), and every output equals
    transformers' generate."""
    path, prompts, expected = mixed
    blocks = {8: 60, 32: 22}[block_size]
    got, llm = _run(path, prompts, 24, block_size=block_size, max_num_batched_tokens=13, num_kv_blocks=blocks,
                    max_num_seqs=4, cpu_kv_cache_gb=0.004, preemption_mode="swap", enable_prefix_caching=caching)
    metrics = llm.engine.get_metrics()
    assert metrics["kv_host_swap_outs"] > 0 and metrics["kv_host_swap_ins"] == metrics["kv_host_swap_outs"]
    assert got == expected
    assert metrics["kv_cache_usage_perc"] == 0.0 and metrics["num_requests_swapped"] == 0
    llm.engine.kv_cache.check_integrity()


@pytest.mark.gpu
def test_preemption_by_swap_through_the_host_tier_on_the_gpu(mixed):
    """The same on CUDA in float32: the copies run on the copy streams from pinned host pages,
    ordered against the forwards (runner/kv_transfer.py), and the outputs still equal
    transformers' generate."""
    path, prompts, expected = mixed
    got, llm = _run(path, prompts, 24, block_size=8, max_num_batched_tokens=13, num_kv_blocks=60, max_num_seqs=4,
                    cpu_kv_cache_gb=0.004, preemption_mode="swap", device="cuda", dtype="float32")
    assert llm.engine.get_metrics()["kv_host_swap_outs"] > 0
    assert got == expected


def test_host_tier_serves_an_evicted_prefix(mixed):
    """A prompt's pages leave a 64-block pool while other prompts run (written back to the
    host first); the prompt again, extended, hits them on the host, loads them, and decodes
    as the model does from scratch."""
    path, prompts, _ = mixed
    llm = LLM(str(path), max_model_len=96, block_size=8, max_num_batched_tokens=32, num_kv_blocks=64,
              cpu_kv_cache_gb=0.004)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate([{"prompt_token_ids": prompts[3]}], greedy, use_tqdm=False)
    llm.generate([{"prompt_token_ids": p} for p in _prompts((60, 60, 60), seed=9)], greedy, use_tqdm=False)
    again = prompts[3] + [7, 8, 9]
    out = llm.generate([{"prompt_token_ids": again}], greedy, use_tqdm=False)[0]
    metrics = llm.engine.get_metrics()
    assert metrics["kv_host_hit_tokens"] > 0 and metrics["kv_host_blocks_to_gpu"] > 0
    assert out.num_cached_tokens >= 64
    assert list(out.outputs[0].token_ids) == greedy_generate(load_deepseek_v4(str(path)), [again], 4)[0]
    llm.engine.kv_cache.check_integrity()


def test_multi_turn_hits(mixed):
    path, prompts, _ = mixed
    llm = LLM(str(path), max_model_len=160, block_size=8, max_num_batched_tokens=13)
    model = load_deepseek_v4(str(path))
    history = prompts[3]  # 70 tokens: block-granular hits can reach 90% of a turn
    for turn in range(3):
        before = llm.engine.get_metrics()["prefix_cache_hits"]
        out = llm.generate([{"prompt_token_ids": history}], SamplingParams(max_tokens=6, temperature=0.0),
                           use_tqdm=False)[0].outputs[0].token_ids
        assert list(out) == greedy_generate(model, [history], 6)[0]
        hits = llm.engine.get_metrics()["prefix_cache_hits"] - before
        if turn:
            assert hits >= 0.9 * previous_len
        previous_len = len(history) + len(out)
        history = history + list(out) + _prompts((5,), seed=turn)[0]


def test_csa_with_ties_matches_float64_reference(tmp_path):
    hf = tiny_v4_model([CSA, CSA])
    hf.save_pretrained(tmp_path)
    prompts = _prompts((3, 17))
    expected = [Reference(hf).greedy(p, 10) for p in prompts]
    for block_size, caching in ((8, True), (16, False)):
        got, _ = _run(tmp_path, prompts, 10, block_size=block_size, enable_prefix_caching=caching,
                      max_num_batched_tokens=5)
        assert got == expected


def test_metrics_and_startup_log_report_groups(mixed, caplog):
    path, prompts, _ = mixed
    with caplog.at_level(logging.INFO, logger="kvserve.model.deepseek_v4.engine"):
        llm = LLM(str(path), max_model_len=160, block_size=8, max_num_batched_tokens=64)
    assert "csa_entries" in caplog.text and "long-run KV bytes/token" in caplog.text
    engine = llm.engine
    for p in prompts[2:]:
        engine.add_request(engine.make_request(p, SamplingParams(max_tokens=4, temperature=0.0)))
    engine.step()
    metrics = engine.get_metrics()
    groups = metrics["kv_cache_group_blocks"]
    held = [engine.kv_cache.get_block_ids(r.request_id) for r in engine.scheduler.running]
    assert list(groups.values()) == [len({b for ids in held for b in ids[g] if b}) for g in range(len(groups))]
    assert any("compressed(1/4" in name for name in groups) and any("compressed(1/8" in name for name in groups)
    tokens = sum(r.num_computed_tokens for r in engine.scheduler.running)
    assert metrics["kv_bytes_per_token"] == sum(groups.values()) * engine.runner.layout.bytes_per_block / tokens


def test_server_serves_v4_and_exports_metrics():
    """The HTTP server (engine core in its own process) with a tiny V4 dummy: a
    token-id completion runs to length and /metrics counts its prefix lookup."""
    import httpx

    from kvserve.config import EngineArgs
    from kvserve.server.app import build_app
    from tests.test_server import LiveServer
    args = EngineArgs(model="dummy:tiny-deepseek-v4", dtype="float32", device="cpu", max_model_len=256)
    with LiveServer(build_app(args, "v4")) as server:
        reply = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "v4", "prompt": list(range(5, 25)), "max_tokens": 5, "temperature": 0})
        assert reply.status_code == 200
        assert reply.json()["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
                                         "prompt_tokens_details": {"cached_tokens": 0}}
        deadline = time.monotonic() + 30  # snapshots reach the API side at a bounded rate
        while "kvserve:prefix_cache_queries_total 20.0" not in httpx.get(f"{server.url}/metrics").text:
            assert time.monotonic() < deadline, "the V4 prefix lookup never reached /metrics"
            time.sleep(0.2)


def test_memory_plan_arithmetic(caplog):
    """The V4 pool plan from free bytes (V4-Flash-L8 dims, 16-token blocks):
    its blocks, what one 32K-token decoding sequence holds per page kind, how
    many fit, and the tokens of context the pool holds once windows are
    negligible; the start-up log says it per group."""
    from kvserve.cache.v4_specs import v4_kv_layout
    from kvserve.model.deepseek_v4.engine import log_plan, plan_v4_memory
    from kvserve.model.deepseek_v4.loader import dummy_config
    config = dummy_config("deepseek-v4-flash-l8")
    layout = v4_kv_layout(config, 16)
    plan = plan_v4_memory(100 * 1024**3, layout, 2)
    assert plan.block_bytes == layout.unit * 2 == 81920 and plan.num_blocks == 1310720
    # Window groups hold their window plus the new token: 2 sliding groups x 9 blocks (128 tokens),
    # 3 CSA state groups x 2 (8 tokens), 2 HCA state groups x 9 (128); entries grow: CSA one
    # block per 16 tokens (4 entries), HCA one per 128 (the slot its window ends in).
    assert plan.blocks_per_seq == {"sliding": 18, "csa_state": 6, "csa_entries": 2048, "hca_state": 18,
                                   "hca_entries": 256}
    assert plan.windows == {"sliding": 128, "csa_state": 8, "hca_state": 128}
    assert plan.num_seqs == (1310720 - 1) // 2346 == 558  # block 0 is the null block
    assert plan.kind_blocks["csa_entries"] == 558 * 2048 and sum(plan.kind_blocks.values()) <= 1310719
    assert plan.max_context_tokens == int(1310719 / (1 / 16 + 1 / 128))
    assert plan_v4_memory(81920 * 2347, layout, 2).num_seqs == 1
    assert plan_v4_memory(81920 * 2346, layout, 2).num_seqs == 0
    with caplog.at_level(logging.INFO, logger="kvserve.model.deepseek_v4.engine"):
        log_plan(plan, config)
    assert "558 sequences fit" in caplog.text and "sliding: window only (128 tokens a sequence" in caplog.text
    assert f"csa_entries: {558 * 32768:,} tokens" in caplog.text and "indexer: its keys are 20%" in caplog.text


@pytest.mark.gpu
def test_cuda_pool_sized_from_gpu_memory_utilization():
    """On CUDA the V4 pool is what gpu_memory_utilization leaves once the
    weights and a profiled peak step are held (and no more than that share)."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    llm = LLM("dummy:tiny-deepseek-v4", device="cuda", dtype="float32", max_model_len=4096,
              gpu_memory_utilization=0.3, enforce_eager=True)
    layout = llm.engine.runner.layout
    pool = layout.num_blocks * layout.bytes_per_block
    assert 0.3 * total - (total - free) - 2 * 1024**3 < pool < 0.3 * total
    del llm
    gc.collect()
    torch.cuda.empty_cache()
