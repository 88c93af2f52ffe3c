"""Shared-prefix (cascade) decode attention (kvserve/attention/kernels/cascade.py): the groups
the host forms from block tables, and the kernels under the Triton interpreter against a float64
softmax over each sequence's whole context, on NaN-poisoned output; on a GPU (`gpu`), the same
against the decode kernel at Qwen3-8B heads in bf16."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.attention.kernels import cascade
from kvserve.attention.kernels.decode import DecodeConfig
from tests.triton_interpreter import run_interpreted


def test_groups_need_two_members_sharing_leading_blocks():
    rows = [[7, 8, 9], [7, 8, 4], [5, 6], [7, 8, 9, 10], [11, 12]]
    lens = [48, 40, 30, 60, 20]
    groups = cascade.plan_groups(rows, lens, page=16)
    # 0, 1, 3 share blocks 7, 8; 2 and 4 are alone
    assert groups == [([0, 1, 3], 32)]


def test_random_groups_keep_every_rule():
    """Random tables (files sharing a header page or not, prompts of every length): members are
    disjoint, 2 to MAX_MEMBERS a group, all hold the group's prefix blocks, the prefix is at least
    MIN_SHARED_PAGES and ends a page before each member's last key; rows of one file with the same
    context group together once the group's whole file prefix fits them."""
    import random
    rng = random.Random(3)
    for _ in range(300):
        files = [[rng.choice([1, 100 + f])] + [1000 * f + k for k in range(1, rng.randint(1, 6))]
                 for f in range(rng.randint(1, 4))]
        rows, lens = [], []
        for i in range(rng.randint(1, 40)):
            f = files[rng.randrange(len(files))]
            rows.append(f + [10 ** 6 + 10 * i + k for k in range(rng.randint(0, 3))])
            lens.append(rng.randint(1, 16 * len(rows[-1])))
        seen = set()
        for members, prefix in cascade.plan_groups(rows, lens, 16):
            pages = prefix // 16
            assert 2 <= len(members) <= cascade.MAX_MEMBERS and not seen & set(members)
            seen |= set(members)
            assert pages >= cascade.MIN_SHARED_PAGES
            assert all(rows[m][:pages] == rows[members[0]][:pages] and prefix <= lens[m] - 1 for m in members)


def test_a_prefix_stops_a_page_before_each_members_last_key():
    """Sequence 1's 49 keys end in block 4's first slot: the prefix may take 3 pages; with 48 its
    last key sits in the third page, so two are shared; with 32 only one would be, under
    MIN_SHARED_PAGES: no group."""
    rows = [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert cascade.plan_groups(rows, [64, 49], page=16) == [([0, 1], 48)]
    assert cascade.plan_groups(rows, [64, 48], page=16) == [([0, 1], 32)]
    assert cascade.plan_groups(rows, [64, 32], page=16) == []


def test_files_sharing_only_a_header_block_form_groups_of_their_own():
    """Two files whose first block (a common header) is the same block: one group each with its
    whole 3-page prefix, not one group of all four cut to the header."""
    rows = [[1, 2, 3, 4, 9], [1, 5, 6, 7, 10], [1, 2, 3, 4, 11], [1, 5, 6, 7, 12]]
    assert cascade.plan_groups(rows, [70] * 4, page=16) == [([0, 2], 64), ([1, 3], 64)]


def test_large_sets_split_into_groups_of_at_most_max_members():
    n = cascade.MAX_MEMBERS * 2 + 1
    groups = cascade.plan_groups([[3, 4]] * n, [40] * n, page=16)
    assert [len(m) for m, _ in groups] == [cascade.MAX_MEMBERS, cascade.MAX_MEMBERS]   # the one left alone
    assert sorted(i for m, _ in groups for i in m) == list(range(cascade.MAX_MEMBERS * 2))


def test_the_plan_tensors_name_each_members_prefix():
    plan = cascade.build_plan([[7, 8, 9], [7, 8, 4], [5, 6]], [48, 40, 30], page=16, device="cpu")
    assert plan.lens.tolist() == [32] and plan.tables.tolist() == [[7, 8]]
    assert plan.members[0, :3].tolist() == [0, 1, -1]
    assert plan.skip.tolist() == [32, 32, 0]


def make_case(device: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, page: int,
              prefixes: list[int], suffixes: list[int], owners: list[int], seed: int):
    """Sequences whose context is a file prefix (`prefixes[owners[i]]` tokens, or none for
    owner -1) in blocks shared by every sequence of that file, then `suffixes[i]` keys of its own;
    the cache's other slots NaN (a stray read shows)."""
    gen = torch.Generator().manual_seed(seed)
    blocks, next_block = {}, 1
    rows, lens = [], []
    for owner, suffix in zip(owners, suffixes):
        prefix = prefixes[owner] if owner >= 0 else 0
        if owner >= 0 and owner not in blocks:
            blocks[owner] = list(range(next_block, next_block + prefix // page))
            next_block += prefix // page
        own = -(-suffix // page)
        rows.append((blocks[owner] if owner >= 0 else []) + list(range(next_block, next_block + own)))
        next_block += own
        lens.append(prefix + suffix)
    cache = torch.full((2, next_block, page, kv_heads, dim), float("nan"))
    for row, n in zip(rows, lens):
        for k in range(n):
            cache[:, row[k // page], k % page] = torch.randn(2, kv_heads, dim, generator=gen)
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    q = torch.randn(len(rows), heads, dim, generator=gen)
    return (q.to(device, dtype), cache.to(device, dtype), table.to(device), rows, lens)


def reference(q, cache, rows, lens, scale):
    """float64 softmax of each sequence's one query over all its keys."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // cache.shape[3]
    for i, (row, n) in enumerate(zip(rows, lens)):
        k = torch.stack([cache[0, row[j // cache.shape[2]], j % cache.shape[2]] for j in range(n)]).double()
        v = torch.stack([cache[1, row[j // cache.shape[2]], j % cache.shape[2]] for j in range(n)]).double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [n, H, D]
        p = torch.einsum("hd,nhd->hn", q[i].double().cpu(), k.cpu()) * scale
        out[i] = torch.einsum("hn,nhd->hd", p.softmax(-1), v.cpu())
    return out


# 16-key tiles (the interpreter's small heads), the decode kernel's warps and stages
TILES16 = DecodeConfig(block_n=16, split_block_n=16)


def interpreter_checks() -> None:
    """Groups of 2 and 3, a set of MAX_MEMBERS + 2 sharing one file (a full group and a pair),
    a sequence in no group, a prefix shorter than its splits; suffix splits past the keys."""
    import triton
    n_big = cascade.MAX_MEMBERS + 2
    owners = [0, 1, 0, -1, 1, 1] + [2] * n_big
    suffixes = [5, 17, 1, 40, 9, 3] + [1 + i % 7 for i in range(n_big)]
    q, cache, table, rows, lens = make_case("cpu", torch.float32, heads=4, kv_heads=2, dim=16, page=4,
                                            prefixes=[24, 8, 12], suffixes=suffixes, owners=owners, seed=0)
    plan = cascade.build_plan(rows, lens, 4, "cpu")
    assert sorted(len(m) for m, _ in cascade.plan_groups(rows, lens, 4)) == [2, 2, 3, cascade.MAX_MEMBERS]
    out = torch.full_like(q, float("nan"))
    qsl = torch.arange(len(rows) + 1, dtype=torch.int32)
    # poisoned partials: a slot no kernel writes (an ungrouped sequence's prefix slots) shows
    parts = (torch.full((len(rows), 4, 5, 16), float("nan")), torch.full((len(rows), 4, 5), float("nan")))
    cascade.cascade_decode_attention(q, cache, out, table, qsl, torch.tensor(lens, dtype=torch.int32), max(lens),
                                     0.25, plan, prefix_splits=3, suffix_splits=2, config=TILES16, parts=parts)
    expected = reference(q, cache, rows, lens, 0.25)
    err = ((out.double() - expected).abs().max()).item()
    assert err < 1e-5, err
    fused_write_check(q, cache, table, rows, lens, plan, qsl, expected)
    backend_check(q, cache, table, rows, lens)
    for heads, kv_heads, limit, padding in ((4, 2, 1, 3), (6, 2, 2, 2), (4, 4, 3, 1)):
        graph_buffers_check(heads, kv_heads, limit, padding)
    print("ok", triton.__version__)


def graph_buffers_check(heads: int, kv_heads: int, limit: int, padding: int) -> None:
    """A decode graph's replay, simulated: static tables padded past the step's rows (padding rows
    of one key, slot -1), plan buffers holding an earlier step's groups before `write` caps this
    step's at `limit`, NaN-poisoned partials and newest slots, the fused write: every real row
    matches float64, padding rows and every partial slot come out finite."""
    page, dim = 4, 16
    q, cache, table, rows, lens = make_case("cpu", torch.float32, heads=heads, kv_heads=kv_heads, dim=dim,
                                            page=page, prefixes=[12, 8, 20], suffixes=[5, 1, 3, 9, 2, 13, 4, 6],
                                            owners=[0, 0, 1, 1, 1, -1, 2, 2], seed=limit)
    n, size, width = len(rows), len(rows) + padding, table.shape[1] + 2
    expected = reference(q, cache, rows, lens, 0.25)
    static_table = torch.zeros(size, width, dtype=torch.int32)
    static_table[:n, :table.shape[1]] = table
    seq_lens = torch.ones(size, dtype=torch.int32)
    seq_lens[:n] = torch.tensor(lens)
    qs = torch.zeros(size, heads, dim)
    qs[:n] = q
    slots = torch.full((size,), -1, dtype=torch.long)
    slots[:n] = torch.tensor([row[(m - 1) // page] * page + (m - 1) % page for row, m in zip(rows, lens)])
    k_new, v_new = torch.zeros(size, kv_heads, dim), torch.zeros(size, kv_heads, dim)
    holed = cache.clone()
    for i, s in enumerate(slots[:n].tolist()):
        k_new[i], v_new[i] = cache[0, s // page, s % page], cache[1, s // page, s % page]
        holed[:, s // page, s % page] = float("nan")
    holed[:, 0] = 0.0   # the null block the padding rows' tables point at
    buffers = cascade.CascadeBuffers(size, 4, width, "cpu")
    buffers.write([(list(range(size)), page)], np.ones((size, width), np.int32), size, page)   # an earlier step
    buffers.write(cascade.plan_groups(cascade.as_table(rows), np.array(lens), page), cascade.as_table(rows), n,
                  page, limit=limit)
    out = torch.full_like(qs, float("nan"))
    parts = (torch.full((size, heads, 6, dim), float("nan")), torch.full((size, heads, 6), float("nan")))
    cascade.cascade_decode_attention(qs, holed, out, static_table, torch.arange(size + 1, dtype=torch.int32),
                                     seq_lens, max(lens), 0.25, buffers.plan(size, limit),
                                     new_kv=(k_new, v_new, slots), parts=parts, suffix_splits=2, config=TILES16)
    assert (out[:n].double() - expected).abs().max().item() < 1e-5, ("graph replay", heads, kv_heads, limit)
    assert torch.isfinite(out[n:]).all() and torch.isfinite(parts[0]).all()


def backend_check(q, cache, table, rows, lens) -> None:
    """The Triton backend's decode step with the runner's plan in the metadata (`meta.cascade`)
    against the same step without it: the same output and the same cache after (the fused write);
    a sliding-window layer ignores the plan."""
    from kvserve.attention.backend import get_backend
    from kvserve.attention.metadata import AttentionMetadata
    from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
    from tests.test_triton_kernels import _layer
    page, n = cache.shape[2], len(rows)
    slots = torch.tensor([row[(m - 1) // page] * page + (m - 1) % page for row, m in zip(rows, lens)])
    k_new = torch.stack([cache[0, s // page, s % page] for s in slots.tolist()])
    v_new = torch.stack([cache[1, s // page, s % page] for s in slots.tolist()])
    from kvserve.attention import triton_backend
    calls, real = [], triton_backend.cascade_decode_attention
    triton_backend.cascade_decode_attention = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    outs, caches = [], []
    for plan in (None, cascade.build_plan(table.numpy(), np.array(lens), page, "cpu")):
        for spec in (FullAttentionSpec(), SlidingWindowSpec(window=9)):
            holed = cache.clone()
            holed[:, slots // page, slots % page] = float("nan")
            meta = AttentionMetadata(n, n, page, torch.arange(n + 1, dtype=torch.int32),
                                     torch.tensor(lens, dtype=torch.int32), [table], [slots], 1, max(lens),
                                     [1] * n, list(lens), cascade=plan)
            outs.append(get_backend("triton").forward(q, k_new, v_new, holed, _layer(spec, 4, 2, 16), meta))
            caches.append(holed.nan_to_num(7.0))
    triton_backend.cascade_decode_attention = real
    assert len(calls) == 1   # the full-attention layer with the plan, only
    for a, b in ((0, 2), (1, 3)):   # full with and without the plan; sliding with and without
        assert (outs[a] - outs[b]).abs().max().item() < 1e-5, ("backend", a, b)
        assert torch.equal(caches[a], caches[b])


def holed_newest(cache, rows, lens):
    """(cache with each sequence's newest slot NaN, that key and value a sequence, the slots):
    what a fused-write decode gets, with the slots it must fill."""
    page = cache.shape[2]
    slots = torch.tensor([row[(n - 1) // page] * page + (n - 1) % page for row, n in zip(rows, lens)])
    k_new = torch.stack([cache[0, s // page, s % page] for s in slots.tolist()])
    v_new = torch.stack([cache[1, s // page, s % page] for s in slots.tolist()])
    holed = cache.clone()
    for s in slots.tolist():
        holed[:, s // page, s % page] = float("nan")
    return holed, k_new, v_new, slots


def fused_write_check(q, cache, table, rows, lens, plan, qsl, expected) -> None:
    """With new_kv, each sequence's newest key comes from k/v (its cache slot NaN before) and lands
    in the slot; the output is the same."""
    holed, k_new, v_new, slots = holed_newest(cache, rows, lens)
    out = torch.full_like(q, float("nan"))
    cascade.cascade_decode_attention(q, holed, out, table, qsl, torch.tensor(lens, dtype=torch.int32), max(lens),
                                     0.25, plan, new_kv=(k_new, v_new, slots), prefix_splits=3, config=TILES16)
    err = ((out.double() - expected).abs().max()).item()
    assert err < 1e-5, ("fused write", err)
    assert torch.equal(holed.nan_to_num(7.0), cache.nan_to_num(7.0)), "the newest keys were not written to their slots"


def test_cascade_kernels_under_interpreter():
    out = run_interpreted("import torch; torch.set_num_threads(1); from tests import test_cascade_attention as t; "
                          "t.interpreter_checks()", timeout=600)
    assert out.startswith("ok")


@pytest.mark.gpu
@pytest.mark.parametrize("per_prefix", [1, 3, 16])
def test_cascade_matches_the_decode_kernel_gpu(per_prefix):
    """Qwen3-8B heads, bf16, 24 sequences of ~900 keys: 700-token prefixes shared `per_prefix`
    ways, against the decode kernel on the same cache."""
    from kvserve.attention.kernels.decode import decode_attention
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    owners = [i // per_prefix for i in range(24)]
    suffixes = [150 + 13 * i % 120 for i in range(24)]
    q, cache, table, rows, lens = make_case("cuda", torch.bfloat16, heads=32, kv_heads=8, dim=128, page=16,
                                            prefixes=[704] * 24, suffixes=suffixes, owners=owners, seed=per_prefix)
    cache = torch.nan_to_num(cache)   # the decode kernel's masked lanes multiply by the page's slots
    qsl = torch.arange(25, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    plan = cascade.build_plan(rows, lens, 16, "cuda")
    out = torch.full_like(q, float("nan"))
    cascade.cascade_decode_attention(q, cache, out, table, qsl, seq_lens, max(lens), 128 ** -0.5, plan)
    expected = decode_attention(q, cache, torch.empty_like(q), table, qsl, seq_lens, max(lens), 128 ** -0.5, None, 0)
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err < 1e-2, err


def test_cascade_kernels_compile_for_sm90():
    """The interpreter runs code the compiler rejects: both kernels at Qwen3-8B heads in bf16,
    compiled for sm_90 offline."""
    from tests.test_deepseek_v4_kernels import compile_for_sm90
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr")} | {
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32", "tables_ptr": "*i32",
        "lens_ptr": "*i32", "members_ptr": "*i32", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
        "skip_ptr": "*i32", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "slot_mapping_ptr": "*i64"}
    common = dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, SUFFIX_SPLITS=1,
                  PREFIX_SPLITS=4, DOT_PRECISION="tf32")
    floats = frozenset({"qk_scale"})
    prefix = compile_for_sm90(cascade._prefix_kernel, ptrs, common | dict(MEMBERS=cascade.MAX_MEMBERS, BLOCK_R=64),
                              num_warps=4, num_stages=2, floats=floats, unaligned=frozenset({"num_parts", "stride_gt"}))
    suffix = compile_for_sm90(cascade._suffix_kernel, ptrs, common | dict(BLOCK_G=16, WRITE_NEW=True), num_warps=4,
                              num_stages=2,
                              floats=floats, unaligned=frozenset({"num_parts", "stride_table"}))
    assert prefix.asm["ptx"] and suffix.asm["ptx"]


def test_the_runner_plans_cascade_only_where_it_serves(monkeypatch):
    """KVSERVE_CASCADE=1 on CUDA with one KV group and no tensor parallelism; never otherwise."""
    from kvserve.runner.model_runner import KVLayout, _cascade_wanted
    layout = KVLayout(64, 16, 2, 1, (0, 1), 8, 128, torch.bfloat16)
    cuda = torch.device("cuda")
    monkeypatch.delenv(cascade.ENV, raising=False)
    assert not _cascade_wanted(cuda, layout, None)
    monkeypatch.setenv(cascade.ENV, "1")
    assert _cascade_wanted(cuda, layout, None)
    assert not _cascade_wanted(torch.device("cpu"), layout, None)
    assert not _cascade_wanted(cuda, KVLayout(64, 16, 2, 2, (0, 1), 8, 128, torch.bfloat16), None)
    assert not _cascade_wanted(cuda, layout, object())   # a tensor-parallel step channel
    monkeypatch.setenv(cascade.ENV, "yes")
    with pytest.raises(ValueError, match="KVSERVE_CASCADE must be 0 or 1, got 'yes'"):
        _cascade_wanted(cuda, layout, None)


def test_graph_buffers_rewrite_every_slot_and_cap_the_groups():
    """A graph's buffers after a step with 3 groups, then one with 1 under a cap of 1: no group or
    skip of the first step survives; a group past the cap leaves its members ungrouped."""
    rows = [[1, 2, 5], [1, 2, 6], [3, 4, 7], [3, 4, 8], [9, 10, 11], [9, 10, 12]]
    table, lens = cascade.as_table(rows), np.array([40] * 6)
    groups = cascade.plan_groups(table, lens, 16)
    buffers = cascade.CascadeBuffers(8, 4, 8, "cpu")
    assert buffers.write(groups, table, 6, 16) == 3
    assert buffers.skip.tolist() == [32] * 6 + [0, 0] and buffers.lens.tolist() == [32, 32, 32, 0]
    assert buffers.write(groups, table, 6, 16, limit=1) == 1
    assert buffers.skip.tolist() == [32, 32, 0, 0, 0, 0, 0, 0]
    assert buffers.lens.tolist() == [32, 0, 0, 0] and (buffers.members[1:] == -1).all()
    assert buffers.tables[0, :2].tolist() == [1, 2] and (buffers.tables[1:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
def test_engine_with_cascade_keeps_greedy_outputs_gpu(tmp_path, monkeypatch, eager):
    """Prompts sharing file prefixes (file 0, cached by a first request, shared by four; file 1
    by seven admitted together; file 2 and two prompts alone), float32: the same tokens with
    KVSERVE_CASCADE=1 as without, with groups formed, in graphs and eagerly."""
    from kvserve import LLM, SamplingParams
    from kvserve.attention import triton_backend
    from tests.tiny_models import random_prompts, save_tiny_checkpoint
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = save_tiny_checkpoint("qwen3", tmp_path / "q", max_position_embeddings=1024)
    files = random_prompts([200, 330, 96], seed=5)
    tails = random_prompts([3 + i % 11 for i in range(14)], seed=6)
    owners = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, -1, -1, 0]
    prompts = [{"prompt_token_ids": (files[o] if o >= 0 else []) + t} for o, t in zip(owners, tails)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def run(flag: str):
        monkeypatch.setenv(cascade.ENV, flag)
        llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=1024, kv_cache_memory_gb=1,
                  enforce_eager=eager, block_size=16)
        llm.generate(prompts[:1], params, use_tqdm=False)   # file 0 cached: later requests share its blocks
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm
    calls, real = [], triton_backend.cascade_decode_attention
    monkeypatch.setattr(triton_backend, "cascade_decode_attention",
                        lambda *a, **kw: calls.append(a[8].num_groups) or real(*a, **kw))
    plain, _ = run("0")
    assert not calls
    tokens, llm = run("1")
    assert tokens == plain
    graphs = llm.engine.runner.graphs
    if eager:
        assert graphs is None and max(calls) >= 1   # eager decode steps planned real groups
    else:   # the last replay's buffers hold the step's groups (capture alone calls the spy)
        assert sum(graphs.num_replays.values()) > 0 and (graphs.cascade.lens > 0).any()


def test_a_decode_streak_keeps_its_groups(monkeypatch):
    """The same requests in the same order as the planned step before: its groups, no new
    grouping; other requests, or a step before that was not planned: grouped again."""
    from types import SimpleNamespace

    from kvserve.runner.model_runner import ModelRunner
    runner = object.__new__(ModelRunner)
    runner.layout, runner.graphs, runner.device = SimpleNamespace(block_size=16), None, torch.device("cpu")
    counted = []
    real = cascade.plan_groups
    monkeypatch.setattr(cascade, "plan_groups", lambda *a: counted.append(1) or real(*a))
    requests = [SimpleNamespace(request=object()) for _ in range(3)]
    table = torch.tensor([[1, 2, 5], [1, 2, 6], [3, 4, 7]], dtype=torch.int32)

    def step(scheduled, previous, sampled=None):
        rows = list(scheduled) if sampled is None else sampled
        n = len(scheduled)
        inputs = SimpleNamespace(host=SimpleNamespace(block_tables=[table[:n]], seq_lens=torch.tensor([40] * n)),
                                 sampling_rows=rows, meta=SimpleNamespace(num_seqs=n, cascade=None), cascade=None)
        decode = object() if sampled is None else None   # every row samples: the decode arrays
        runner._plan_cascade(inputs, SimpleNamespace(scheduled=scheduled, decode=decode), previous)
        return inputs, SimpleNamespace(rows=rows)
    first, previous = step(requests, None)
    second, previous = step(requests, previous)
    assert len(counted) == 1 and second.cascade[0] is first.cascade[0] == [([0, 1], 32)]
    assert second.meta.cascade is not None   # no graph here: the eager plan's tensors
    step(requests[:2] + [SimpleNamespace(request=object())], previous)   # another request joined
    assert len(counted) == 2
    step(requests, SimpleNamespace(rows=list(requests)))   # a step this runner did not plan
    assert len(counted) == 3


def test_a_step_whose_rows_did_not_all_sample_is_grouped_again(monkeypatch):
    """A decode-only step where one row (a one-token prompt chunk short of its prompt's end) does
    not sample: the next step's rows may equal its sampled rows while every row after the chunk
    has moved up one place, so its groups (row indices) must not be reused."""
    from types import SimpleNamespace

    from kvserve.runner.model_runner import ModelRunner
    runner = object.__new__(ModelRunner)
    runner.layout, runner.graphs, runner.device = SimpleNamespace(block_size=16), None, torch.device("cpu")
    a, b, c, d = (SimpleNamespace(request=object()) for _ in range(4))
    full = torch.tensor([[1, 2, 5], [3, 4, 6], [1, 2, 7], [3, 4, 8]], dtype=torch.int32)   # A, C file 1; B, D file 3

    def step(scheduled, table, sampled, decode, previous):
        inputs = SimpleNamespace(host=SimpleNamespace(block_tables=[table], seq_lens=torch.tensor([40] * len(table))),
                                 sampling_rows=sampled, meta=SimpleNamespace(num_seqs=len(table), cascade=None),
                                 cascade=None)
        runner._plan_cascade(inputs, SimpleNamespace(scheduled=scheduled, decode=decode), previous)
        return inputs.cascade[0], SimpleNamespace(rows=sampled)
    first, previous = step([a, b, c, d], full, [a, b, d], None, None)   # C's chunk samples nothing
    assert first == [([0, 2], 32), ([1, 3], 32)]
    second, _ = step([a, b, d], full[[0, 1, 3]], [a, b, d], object(), previous)   # C preempted
    assert second == [([1, 2], 32)]
