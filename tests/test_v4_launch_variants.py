"""benchmarks/v4_launch_variants.py: the V4 kernel builds a growing context asks for.

A served prompt's context grows chunk by chunk; each launch signature it meets for the first time
compiles inside that step (a 64K-token prompt's prefill took 36.4 s in an H100 machine's first
run and 1.3 s once its Triton cache held the builds). The indexer's score rows are as wide as the
context: unless their width keeps the stride a multiple of 16, Triton builds the score and top-k
kernels twice over for that alone. The start-up warm-up (`kernels/warmup.py`) must launch every
build a growing context asks for.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import v4_launch_variants as lv  # noqa: E402
from tests.triton_interpreter import run_interpreted  # noqa: E402

CONTEXTS = list(range(1000, 131072, 777))


def test_the_score_rows_stride_asks_for_no_second_build():
    found = lv.census([512, 8192], CONTEXTS)
    assert len(found["_index_scores_kernel"]) == 1
    assert "stride_st" not in lv.varying(found["_top_k_kernel"])
    # the top-k's own shape choices: one-tile rows, then one shortcut group size an octave to 128K
    assert len(found["_top_k_kernel"]) == 6


def test_the_census_records_launches_without_running_them():
    found = lv.census([8192], [8192, 65536])
    assert set(found) == {"_index_scores_kernel", "_top_k_kernel", "_key_plan_kernel", "_sparse_attention_kernel"}
    groups = {dict(s)["GROUP"] for s in found["_top_k_kernel"]}
    assert groups == {0, 8}   # 2,048 entries: no shortcut; 16,384: groups of 8


@pytest.mark.parametrize("max_model_len", [131072, 50000, 8192])
def test_the_start_up_warm_up_builds_every_top_k_a_growing_context_asks_for(max_model_len):
    """Each top-k build that steps of 1 to 8,192 tokens at contexts up to max_model_len ask for
    was launched by `warm_top_k` (the same signature: the same compiled kernel)."""
    import torch

    from kvserve.model.deepseek_v4.kernels.warmup import warm_top_k
    with lv.recorded_launches() as warmed:
        count = warm_top_k(torch.device("meta"), max_model_len, lv.CSA_RATE, lv.TOPK)
    contexts = sorted(set(range(1, max_model_len + 1, 997)) | {max_model_len})
    asked = lv.census([1, 8192], contexts)["_top_k_kernel"]
    assert asked <= warmed["_top_k_kernel"]
    assert count == len(warmed["_top_k_kernel"]) <= 12   # one or two an octave of entries


def test_the_row_bounds_are_one_length_a_build():
    from kvserve.model.deepseek_v4.kernels.indexer import TOP_K_CONFIG, TopKBuild
    from kvserve.model.deepseek_v4.kernels.warmup import top_k_row_bounds
    bounds = top_k_row_bounds(32768, 512)
    builds = [TopKBuild.of(n, 512, TOP_K_CONFIG) for n in bounds]
    assert len(set(builds)) == len(bounds) and bounds[0] == 1 and bounds[-1] <= 32768
    assert {TopKBuild.of(n, 512, TOP_K_CONFIG) for n in range(1, 32769, 7)} <= set(builds)


def _meta_runner(config):
    from types import SimpleNamespace

    import torch

    from kvserve.cache.v4_specs import v4_kv_layout
    from kvserve.model.deepseek_v4 import loader
    layout = v4_kv_layout(config, 16)
    storage = torch.empty(4, layout.unit, dtype=torch.bfloat16, device="meta")
    return SimpleNamespace(device=torch.device("meta"), kv_storage=storage, layout=SimpleNamespace(kv=layout),
                           model=loader._build(config, torch.bfloat16, "meta"))


def test_the_engine_warms_its_top_k_its_prefill_attention_and_its_routed_experts():
    from kvserve.model.deepseek_v4.engine import _warm_kernels
    from kvserve.model.deepseek_v4.loader import dummy_config
    config = dummy_config("deepseek-v4-flash", {"num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4]})
    with lv.recorded_launches() as warmed:
        _warm_kernels(config, _meta_runner(config), 65536, 8192)
    assert {dict(s)["RATE"] for s in warmed["_top_k_kernel"]} == {4}
    assert len(warmed["_top_k_kernel"]) == 8   # rows of 1 to 16,384 entries
    attention = [dict(s) for s in warmed["_sparse_attention_kernel"]]
    assert sorted((a["RATE"], a["num_stages"]) for a in attention if not a["PLANNED"]) == [
        (0, 3), (4, 2), (4, 3), (128, 2), (128, 3)]   # small steps for every layer kind; prefill, compressed ones
    assert len(warmed["_route_kernel"]) == 32   # 256 experts
    sliding_only = dummy_config("deepseek-v4-flash", {"compress_ratios": [0, 0], "num_hidden_layers": 2})
    with lv.recorded_launches() as sliding:
        _warm_kernels(sliding_only, _meta_runner(sliding_only), 65536, 8192)
    assert set(sliding) == {"_router_kernel", "_route_kernel", "_gate_up_kernel", "_down_kernel",
                            "_sparse_attention_kernel", "_reduce_kernel"}   # no top-k, no compressed attention
    assert {dict(s)["RATE"] for s in sliding["_sparse_attention_kernel"]} == {0}


def test_the_warm_up_builds_the_attention_long_prefill_chunks_ask_for():
    """Every unplanned (prefill config) attention build that chunks of 6,600 and 8,192 tokens ask for
    at contexts to 131,072 was launched by `warm_prefill_attention`, on the same pages."""
    from kvserve.model.deepseek_v4.kernels.pages import V4PagedBatch
    from kvserve.model.deepseek_v4.kernels.warmup import AttentionPages, warm_prefill_attention
    asked = {s for s in lv.census([6600, 8192], CONTEXTS)["_sparse_attention_kernel"] if not dict(s)["PLANNED"]}
    one, sliding, csa, hca = lv.pages(16 * lv.BLOCK)
    padding = V4PagedBatch(one.storage, one.layout, one.block_tables, one.seq_idx, one.positions, 131072)
    layers = [AttentionPages(sliding, csa, lv.CSA_RATE, lv.TOPK), AttentionPages(sliding, hca, lv.HCA_RATE, None)]
    with lv.recorded_launches() as warmed:
        warm_prefill_attention(padding, layers, lv.H, lv.D, lv.WINDOW)
    assert asked and asked <= warmed["_sparse_attention_kernel"]


def test_the_warm_up_builds_the_gluon_attention_prompt_chunks_ask_for(monkeypatch):
    """Every Gluon attention build that steps of 8 to 8,192 tokens ask for at contexts to 131,072
    (wherever their plan is small enough for it) was launched by `warm_gluon_attention`. The kernel
    cannot run on meta tensors: `supports` is made to say yes, so the launches record, and the
    device has an H100's 132 SMs, so short steps take two programs a token."""
    gluon = pytest.importorskip("kvserve.model.deepseek_v4.kernels.sparse_decode_gluon")
    from kvserve.model.deepseek_v4.kernels.pages import V4PagedBatch
    from kvserve.model.deepseek_v4.kernels.warmup import AttentionPages, warm_gluon_attention
    monkeypatch.setattr(gluon, "supports", lambda *args: True)
    monkeypatch.setattr(gluon, "sm_count", lambda device: 132)
    asked = lv.census([8, 30, 66, 100, 512, 8192], CONTEXTS)["_sparse_decode_kernel"]
    one, sliding, csa, hca = lv.pages(16 * lv.BLOCK)
    padding = V4PagedBatch(one.storage, one.layout, one.block_tables, one.seq_idx, one.positions, 131072)
    layers = [AttentionPages(sliding, csa, lv.CSA_RATE, lv.TOPK), AttentionPages(sliding, hca, lv.HCA_RATE, None)]
    with lv.recorded_launches() as warmed:
        warm_gluon_attention(padding, layers, lv.H, lv.D, lv.WINDOW)
    assert len({dict(s)["MAX_TILES"] for s in asked}) >= 4   # the chunks do cross key bounds
    assert {dict(s)["PARTS"] for s in asked} == {1, 2}
    assert asked <= warmed["_sparse_decode_kernel"]


@pytest.mark.parametrize("num_sms", [4, 132])
def test_the_small_step_splits_meet_every_reduction_build(num_sms):
    """Brute force over every key count, not tiles: each split count a step of 1 to 8 tokens plans
    (the small-step config) has its reduction build among `small_step_splits`' counts, and each of
    those counts is one that some step plans."""
    import triton

    from kvserve.model.deepseek_v4.kernels.sparse_attention import DECODE_CONFIGS, plan_splits
    from kvserve.model.deepseek_v4.kernels.warmup import small_step_splits
    bound, config = DECODE_CONFIGS[0]
    pow2 = lambda s: max(2, triton.next_power_of_2(s))   # noqa: E731 (the kernel's SPLITS_POW2)
    most = 128 + 131072 // 128   # an HCA token's keys at 128K: its window and every entry
    planned = {plan_splits(n, keys, num_sms, config) for n in range(1, bound + 1) for keys in range(1, most + 1)}
    warmed = small_step_splits(most, 64, num_sms)
    assert {pow2(s) for s in planned if s > 1} == {pow2(s) for s in warmed}
    assert set(warmed) <= planned and len(warmed) == len({pow2(s) for s in warmed})


SMALL_STEPS_RUN = """
import os, sys, torch
os.environ["KVSERVE_WARMUP_THREADS"] = "1"   # the interpreter is not thread-safe: a thread's failure would rerun a build
from kvserve.cache.v4_specs import v4_kv_layout
from kvserve.model.deepseek_v4 import loader
from kvserve.model.deepseek_v4.engine import _compressed_layers, _sliding_layer
from kvserve.model.deepseek_v4.kernels import warmup
import kvserve.model.deepseek_v4.kernels.sparse_attention
sa = sys.modules["kvserve.model.deepseek_v4.kernels.sparse_attention"]
config = loader.dummy_config("tiny-deepseek-v4", {})
layout = v4_kv_layout(config, 16)
batch = warmup.padding_batch(torch.zeros(8, layout.unit), layout, 65536)
layers = _compressed_layers(config, batch) + _sliding_layer(config, batch)
kernel, seen = sa._reduce_kernel, []
class Reduce:
    def __getitem__(self, grid):
        return lambda *a, **k: seen.append(k["SPLITS_POW2"]) or kernel[grid](*a, **k)
sa._reduce_kernel = Reduce()
n = warmup.warm_small_step_attention(batch, layers, config.num_attention_heads, config.head_dim, config.sliding_window)
print(len(layers), n, sorted(seen))
"""


def test_the_small_step_warm_up_runs_its_launches_under_the_interpreter():
    """The small-step warm-up's launches run (not only record), on a tiny V4's padding batch at
    64K: one per layer kind (CSA, HCA, sliding-only) with one split, then the reductions the plan
    asks for on the interpreter's 4 SMs (splits 2 and 4)."""
    out = run_interpreted(SMALL_STEPS_RUN, timeout=300)
    assert out.split("\n")[-2] == "3 5 [2, 4]"


def test_the_warm_up_builds_the_routed_experts_every_step_size_asks_for():
    """Every route and grouped-GEMM build that steps of 1 to 8,192 tokens ask for in a V4-Flash MoE
    layer (on meta tensors) was launched by `warm_moe`; the route's pair block alone moves ten times."""
    import torch

    from kvserve.model.deepseek_v4 import loader
    from kvserve.model.deepseek_v4.kernels.moe import fused_moe
    from kvserve.model.deepseek_v4.kernels.warmup import warm_moe
    config = loader.dummy_config("deepseek-v4-flash-l8", {})
    moe = loader._build(config, torch.bfloat16, "meta").layers[config.mlp_layer_types.index("moe")].ffn
    kernels = ("_route_kernel", "_gate_up_kernel", "_down_kernel")
    with lv.recorded_launches() as asked:
        for n in sorted(set(range(1, 8193, 5)) | {1 << i for i in range(14)} | {8192}):
            x = torch.zeros(n, config.hidden_size, dtype=torch.bfloat16, device="meta")
            weights, indices = moe.gate.forward_fused(x, torch.zeros(n, dtype=torch.long, device="meta"))
            fused_moe(x, moe.w1, moe.w3, moe.w2, weights, indices, moe.limit)
    with lv.recorded_launches() as warmed:
        count = warm_moe(moe, 8192, torch.device("meta"))
    assert len({dict(s)["BLOCK_P"] for s in asked["_route_kernel"]}) == 10
    for name in kernels:
        assert asked[name] <= warmed[name], name
    assert count == len(warmed["_route_kernel"]) <= 64


def test_whole_model_steps_ask_for_no_top_k_gluon_or_expert_build_the_start_up_did_not_make(monkeypatch):
    """The whole V4-Flash-L8 forward (every layer, on meta tensors) at steps of 1 to 8,192 tokens and
    contexts to 65,536: its top-k, Gluon attention and routed-expert builds are all among those
    `_warm_kernels` launched, on the engine's own pages and layers; so are its unplanned attention
    builds (the prefill config's and the small-step config's, sliding-only layers included) and their
    split reductions."""
    gluon = pytest.importorskip("kvserve.model.deepseek_v4.kernels.sparse_decode_gluon")
    from kvserve.model.deepseek_v4.engine import _warm_kernels
    from kvserve.model.deepseek_v4.loader import dummy_config
    contexts = list(range(1, 65537, 8191)) + [65536]
    asked = lv.model_census([1, 7, 16, 100, 1000, 8192], contexts)
    monkeypatch.setattr(gluon, "supports", lambda *args: True)
    monkeypatch.setattr(gluon, "sm_count", lambda device: 132)
    config = dummy_config("deepseek-v4-flash-l8", {})
    with lv.recorded_launches() as warmed:
        _warm_kernels(config, _meta_runner(config), 65536, 8192)
    for name in ("_top_k_kernel", "_sparse_decode_kernel", "_route_kernel", "_gate_up_kernel", "_down_kernel",
                 "_reduce_kernel"):
        assert asked[name] <= warmed[name], name
    unplanned = {s for s in asked["_sparse_attention_kernel"] if not dict(s)["PLANNED"]}
    assert {dict(s)["num_stages"] for s in unplanned} == {2, 3}   # both configs: a step of 1 and one of 8,192
    assert {dict(s)["RATE"] for s in unplanned} == {0, 4, 128}
    assert unplanned <= warmed["_sparse_attention_kernel"]


def test_the_warm_up_threads_run_every_build_and_pass_on_a_failure(monkeypatch):
    import threading

    import torch

    from kvserve.model.deepseek_v4.kernels import warmup
    seen, names = [], {}

    def record(item):
        seen.append(item)
        names[item] = threading.current_thread().name
    monkeypatch.setenv(warmup.WARMUP_THREADS_ENV, "3")
    warmup._each(record, list(range(7)), torch.device("cpu"))
    assert sorted(seen) == list(range(7))
    # the first launch sets up what the rest share: on the calling thread, before any worker starts
    assert seen[0] == 0 and names[0] == threading.current_thread().name
    assert all(names[i].startswith("v4-warmup") for i in range(1, 7))

    def fail(item):
        if item == 5:
            raise RuntimeError("build 5 failed")
    with pytest.raises(RuntimeError, match="build 5 failed"):   # on the threads, then again in turn
        warmup._each(fail, list(range(7)), torch.device("cpu"))
    done = []

    def fails_on_workers(item):
        if threading.current_thread().name.startswith("v4-warmup"):
            raise RuntimeError("not on a worker")
        done.append(item)
    warmup._each(fails_on_workers, list(range(7)), torch.device("cpu"))   # falls back to one at a time
    assert sorted(done) == list(range(7))
    calls = []

    def four_fails_on_a_worker(item):
        calls.append(item)
        if item == 4 and threading.current_thread().name.startswith("v4-warmup"):
            raise RuntimeError("build 4 failed on a worker")
    warmup._each(four_fails_on_a_worker, list(range(7)), torch.device("cpu"))
    # the failed build runs again; the rest run once, on a worker or (cancelled by 4's failure) in turn
    assert sorted(calls) == [0, 1, 2, 3, 4, 4, 5, 6]
    monkeypatch.setenv(warmup.WARMUP_THREADS_ENV, "0")
    with pytest.raises(ValueError, match="KVSERVE_WARMUP_THREADS must be a whole number >= 1, got '0'"):
        warmup._each(record, [1, 2], torch.device("cpu"))


def test_the_warm_up_threads_name_the_gpu_by_its_index(monkeypatch):
    """A bare "cuda" device (as the engine may hold it) becomes the current GPU's index: a worker
    thread's `torch.cuda.set_device` refuses a device without one."""
    import torch

    from kvserve.model.deepseek_v4.kernels.warmup import cuda_index
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_index(torch.device("cuda")) == 3
    assert cuda_index(torch.device("cuda", 1)) == 1
    assert cuda_index(torch.device("cpu")) is None and cuda_index(torch.device("meta")) is None


@pytest.mark.gpu
def test_warm_top_k_runs_on_the_gpu():
    """The warm-up's launches build and run on the GPU: ten builds at 128K."""
    import torch

    from kvserve.model.deepseek_v4.kernels.warmup import warm_top_k
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert warm_top_k(torch.device("cuda"), 131072, 4, 512) == 10
    torch.cuda.synchronize()
