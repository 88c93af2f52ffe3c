"""Decode attention over a work list (kvserve/attention/kernels/decode_work.py): the host's
plan, the kernels under the Triton interpreter against a float64 softmax over each sequence's
context on NaN-poisoned output, a graph's buffer rewritten for a smaller step; on a GPU
(`gpu`), against the decode kernel at Qwen3-8B heads in bf16 and the engine's greedy tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.attention.kernels import decode_work as dw
from kvserve.attention.kernels.decode import DecodeConfig
from tests.test_cascade_attention import holed_newest, make_case, reference
from tests.triton_interpreter import run_interpreted


def items_of(work: np.ndarray, n: int, cap: int):
    seq, split = work[:cap], work[cap:2 * cap]
    return seq, split, work[2 * cap:2 * cap + n], work[2 * cap + n:]


@pytest.mark.parametrize("keys", [[900] * 24, [2600] + [260 + 37 * i for i in range(23)], [1] * 8 + [8000], [5]])
def test_plan_lists_every_split_once_within_capacity(keys):
    """Each sequence's splits are items first..first+n-1 with splits 0..n-1, padding is -1, a
    long context takes more splits than a short one, and equal contexts split alike."""
    n, kv_heads, sms = len(keys), 8, 132
    cap = dw.capacity(n, kv_heads, sms)
    work = dw.plan_work(np.array(keys), kv_heads, sms, cap)
    seq, split, splits, first = items_of(work, n, cap)
    total = int(splits.sum())
    assert total <= cap and (seq[total:] == -1).all() and (splits >= 1).all()
    for i in range(n):
        assert (seq[first[i]:first[i] + splits[i]] == i).all()
        assert list(split[first[i]:first[i] + splits[i]]) == list(range(splits[i]))
    order = np.argsort(keys, kind="stable")
    assert (np.diff(splits[order]) >= 0).all()       # more keys, no fewer splits
    if len(set(keys)) == 1:
        assert len(set(splits)) == 1


def test_plan_respects_a_small_capacity_and_the_split_cap():
    work = dw.plan_work(np.array([4000, 4000, 100]), 8, 132, cap=5)
    seq, _, splits, _ = items_of(work, 3, 5)
    assert splits.sum() <= 5 and (seq[:splits.sum()] >= 0).all()
    work = dw.plan_work(np.array([60000]), 1, 1000, cap=dw.capacity(1, 1, 1000))
    assert items_of(work, 1, dw.capacity(1, 1, 1000))[2][0] == dw.MAX_SEQ_SPLITS
    with pytest.raises(ValueError, match="capacity 2 cannot hold 3 sequences"):
        dw.plan_work(np.array([10, 0, 10, 10]), 8, 132, cap=2)


TILES16 = DecodeConfig(block_n=16, split_block_n=16, min_split_keys=16)


def interpreter_checks() -> None:
    """Skewed contexts (one long, several short, one of a single key), 4 query heads on 2 KV
    heads; fused write of the step's K/V; then a buffer that held a larger step's list
    rewritten for a smaller one (a graph's replay)."""
    import triton
    suffixes = [150, 9, 23, 1, 40, 70, 3]
    q, cache, table, rows, lens = make_case("cpu", torch.float32, heads=4, kv_heads=2, dim=16, page=4,
                                            prefixes=[0], suffixes=suffixes, owners=[-1] * 7, seed=1)
    qsl = torch.arange(len(rows) + 1, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = reference(q, cache, rows, lens, 0.25)
    work = dw.device_work(np.array(lens), 2, "cpu", TILES16)
    assert int(work.seq_splits.max()) > 1 and int(work.seq_splits.min()) == 1
    out = torch.full_like(q, float("nan"))
    dw.work_decode_attention(q, cache, out, table, qsl, seq_lens, 0.25, work, config=TILES16)
    assert ((out.double() - expected).abs().max()).item() < 1e-5
    fused_write_check(q, cache, table, rows, lens, qsl, seq_lens, expected)
    replay_check(q, cache, table, lens, qsl, seq_lens, expected)
    mixed_rows_check(q, cache, table, lens, seq_lens, expected)
    print("ok", triton.__version__)


def fused_write_check(q, cache, table, rows, lens, qsl, seq_lens, expected) -> None:
    """The newest key from k_new/v_new (its cache slot NaN before): the same output, the slot written."""
    holed, k_new, v_new, slots = holed_newest(cache, rows, lens)
    out = torch.full_like(q, float("nan"))
    work = dw.device_work(np.array(lens), 2, "cpu", TILES16)
    dw.work_decode_attention(q, holed, out, table, qsl, seq_lens, 0.25, work, config=TILES16,
                             new_kv=(k_new, v_new, slots))
    assert ((out.double() - expected).abs().max()).item() < 1e-5
    assert torch.equal(torch.nan_to_num(holed, 7.0), torch.nan_to_num(cache, 7.0))


def replay_check(q, cache, table, lens, qsl, seq_lens, expected) -> None:
    """A graph's buffer: first the list of a step with every context at its longest, then this
    step's, written over it in full; stale items past this step's must not run."""
    cap = dw.capacity(len(lens), 2, 4, TILES16)
    buffer = torch.from_numpy(dw.plan_work(np.full(len(lens), 10 ** 4), 2, 4, cap, TILES16))
    buffer.copy_(torch.from_numpy(dw.plan_work(np.array(lens), 2, 4, cap, TILES16)))
    out = torch.full_like(q, float("nan"))
    dw.work_decode_attention(q, cache, out, table, qsl, seq_lens, 0.25, dw.DecodeWork.views(buffer, len(lens), cap),
                             config=TILES16)
    assert ((out.double() - expected).abs().max()).item() < 1e-5


def mixed_rows_check(q, cache, table, lens, seq_lens, expected) -> None:
    """A mixed batch (rows 0 and 4 carry three query tokens, the varlen kernel's): the list has
    items for the one-query rows only; they match the reference, the prompt rows stay NaN."""
    q_lens = [3, 1, 1, 1, 3, 1, 1]
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    qm = torch.randn(int(starts[-1]), *q.shape[1:])
    for i, end in enumerate(starts[1:]):
        qm[end - 1] = q[i]   # each row's last query token is the one at its newest key
    keys = np.where(np.array(q_lens) == 1, lens, 0)
    cap = dw.capacity(len(lens), 2, 4, TILES16)
    work = dw.DecodeWork.views(torch.from_numpy(dw.plan_work(keys, 2, 4, cap, TILES16)), len(lens), cap)
    out = torch.full_like(qm, float("nan"))
    dw.work_decode_attention(qm, cache, out, table, torch.tensor(starts, dtype=torch.int32), seq_lens, 0.25, work,
                             config=TILES16)
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        if q_lens[i] == 1:
            assert ((out[a].double() - expected[i]).abs().max()).item() < 1e-5, i
        else:
            assert torch.isnan(out[a:b]).all(), ("wrote a prompt row", i)


def test_work_kernels_under_interpreter():
    out = run_interpreted("import torch; torch.set_num_threads(1); from tests import test_decode_work as t; "
                          "t.interpreter_checks()", timeout=600)
    assert out.startswith("ok")


def test_work_kernels_compile_for_sm90():
    """Both kernels at Qwen3-8B heads in bf16, compiled for sm_90 offline."""
    from tests.test_deepseek_v4_kernels import compile_for_sm90
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "k_new_ptr", "v_new_ptr", "out_ptr")} | {
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32", "block_table_ptr": "*i32",
        "seq_lens_ptr": "*i32", "item_seq_ptr": "*i32", "item_split_ptr": "*i32", "seq_splits_ptr": "*i32",
        "seq_first_ptr": "*i32", "slot_mapping_ptr": "*i64"}
    kernel = compile_for_sm90(dw._work_kernel, ptrs, dict(NUM_HEADS=32, GROUP=4, BLOCK_G=16, HEAD_DIM=128,
                                                          PAGE_SIZE=16, BLOCK_N=32, DOT_PRECISION="tf32",
                                                          WRITE_NEW=True),
                              num_warps=2, num_stages=4, floats=frozenset({"qk_scale"}),
                              unaligned=frozenset({"cap", "stride_table"}))
    reduce = compile_for_sm90(dw._work_reduce_kernel, ptrs, dict(SPLITS_POW2=16, HEAD_DIM=128), num_warps=4,
                              num_stages=1, unaligned=frozenset({"cap"}))
    assert kernel.asm["ptx"] and reduce.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("contexts", ["skewed", "equal"])
def test_work_matches_the_decode_kernel_gpu(contexts):
    """Qwen3-8B heads, bf16, 24 sequences (one of 2,600 keys beside short ones, or all ~900),
    against the decode kernel on the same cache, with the fused write."""
    from kvserve.attention.kernels.decode import decode_attention
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    suffixes = [2600] + [260 + 37 * i for i in range(23)] if contexts == "skewed" else [900 + i for i in range(24)]
    q, cache, table, rows, lens = make_case("cuda", torch.bfloat16, heads=32, kv_heads=8, dim=128, page=16,
                                            prefixes=[0], suffixes=suffixes, owners=[-1] * 24, seed=3)
    cache = torch.nan_to_num(cache)
    qsl = torch.arange(25, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    dw.work_decode_attention(q, cache, out, table, qsl, seq_lens, 128 ** -0.5, dw.device_work(np.array(lens), 8, "cuda"))
    expected = decode_attention(q, cache, torch.empty_like(q), table, qsl, seq_lens, max(lens), 128 ** -0.5, None, 0)
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err < 1e-2, err


def test_the_runner_plans_work_only_where_it_serves(monkeypatch):
    """On CUDA without tensor parallelism unless KVSERVE_DECODE_WORK=0; never otherwise."""
    from kvserve.runner.model_runner import _work_wanted
    cuda = torch.device("cuda")
    monkeypatch.delenv(dw.ENV, raising=False)
    assert _work_wanted(cuda, None)
    monkeypatch.setenv(dw.ENV, "0")
    assert not _work_wanted(cuda, None)
    monkeypatch.setenv(dw.ENV, "1")
    assert _work_wanted(cuda, None)
    assert not _work_wanted(torch.device("cpu"), None)
    assert not _work_wanted(cuda, object())   # a tensor-parallel step channel
    monkeypatch.setenv(dw.ENV, "on")
    with pytest.raises(ValueError, match="KVSERVE_DECODE_WORK must be 0 or 1, got 'on'"):
        _work_wanted(cuda, None)


@pytest.mark.gpu
def test_engine_with_work_lists_keeps_greedy_outputs_gpu(tmp_path, monkeypatch):
    """Prompts of skewed lengths (one of ~900 tokens beside short ones), float32, CUDA graphs,
    256 tokens a step (the long prompt's chunks run in mixed graphs beside decodes): the same
    tokens with KVSERVE_DECODE_WORK=1 as without, its lists replayed in decode and mixed graphs,
    with several splits for the long prompt."""
    from kvserve import LLM, SamplingParams
    from kvserve.attention import triton_backend
    from tests.tiny_models import random_prompts, save_tiny_checkpoint
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = save_tiny_checkpoint("qwen3", tmp_path / "q", max_position_embeddings=2048)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([900] + [20 + 17 * i for i in range(12)], seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(flag: str):
        monkeypatch.setenv(dw.ENV, flag)
        llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=2048, kv_cache_memory_gb=1, block_size=16,
                  max_num_batched_tokens=256)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm
    calls, real = [], triton_backend.work_decode_attention
    monkeypatch.setattr(triton_backend, "work_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    plain, _ = run("0")
    assert not calls
    tokens, llm = run("1")
    assert tokens == plain
    graphs = llm.engine.runner.graphs
    assert calls and sum(graphs.num_replays.values()) > 0
    assert sum(llm.engine.runner.mixed_graphs.num_replays.values()) > 0
    size = graphs.padded_size(len(prompts))
    assert int(graphs.work.views(size).seq_splits.max()) > 1   # the last replay split the long prompt


def test_graph_work_lists_skip_only_rewrites_that_change_nothing(monkeypatch):
    """`WorkLists.write` leaves the buffer when the list would be the one it holds: after every
    write of a decode streak (keys + 1 a step, the split counts mostly unchanged), of another
    graph size between, and of rows whose splits are the held ones reordered, the buffer equals
    a fresh plan, and most of the streak's writes were skipped."""
    from kvserve.runner.cuda_graph import WorkLists

    class Model:   # one KV head on 4 "SMs": 16 programs a head
        local_attention_heads = (4, 1)
    work = WorkLists.for_model(Model(), 32, torch.device("cpu"))
    layouts, real = [], dw.work_layout
    monkeypatch.setattr(dw, "work_layout", lambda *a: layouts.append(1) or real(*a))
    rng = np.random.default_rng(3)
    base = rng.integers(1, 3000, 16)
    steps = [(base + i, 16) for i in range(40)]
    steps[20:20] = [(rng.integers(1, 3000, 32), 32)]
    steps += [(base[::-1] + 39, 16), (base + 39, 16)]   # the same splits in another order, then back
    for keys, n in steps:
        work.write(keys, n)
        cap = work.capacity(n)
        views, fresh = work.views(n), real(dw.plan_splits(keys, 1, 4, cap), cap)
        assert (torch.cat([views.item_seq, views.item_split, views.seq_splits, views.seq_first]).numpy() == fresh).all()
    assert 4 <= len(layouts) < len(steps) // 2


def test_graph_work_lists_rewrite_every_slot_a_graph_reads():
    """The runner's buffer (`WorkLists`, CPU here): a 16-row graph's list after a 32-row one's
    matches a fresh plan in every slot the 16-row views read; a mixed graph's prompt rows get no
    item and read as one split."""
    from kvserve.runner.cuda_graph import WorkLists

    class Model:   # one KV head: 16 programs a head on the interpreter's 4 "SMs", so 2,600 keys split
        local_attention_heads = (4, 1)
    work = WorkLists.for_model(Model(), 32, torch.device("cpu"))
    assert WorkLists.for_model(object(), 32, torch.device("cpu")) is None
    work.write(np.full(32, 5000), 32)
    keys = np.array([2600] + [300] * 10 + [1] * 5)
    work.write(keys, 16)
    views, fresh = work.views(16), dw.plan_work(keys, 1, 4, work.capacity(16))
    got = torch.cat([views.item_seq, views.item_split, views.seq_splits, views.seq_first]).numpy()
    assert (got == fresh).all() and int(views.seq_splits[0]) > int(views.seq_splits[1]) >= 1
    work.write(np.where(np.arange(16) % 2 == 0, keys, 0), 16)   # odd rows: a mixed step's prompt rows
    views = work.views(16)
    listed = set(views.item_seq[views.item_seq >= 0].tolist())
    assert listed == set(range(0, 16, 2)) and (views.seq_splits[1::2] == 1).all()
