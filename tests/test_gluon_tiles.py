"""The Gluon prefill kernel's work list (`prefill_gluon.plan_tiles`), checked on the host against
a brute-force enumeration, and the backend's once-a-step list (`triton_backend.gluon_tile_list`).
The kernel over the list is checked on the GPU (tests/test_prefill_gluon.py)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

prefill_gluon = pytest.importorskip("kvserve.attention.kernels.prefill_gluon")


def brute_force(query_lens, seq_lens, group, min_q_len, block_n):
    """{(seq, first): key tiles} for every query tile of each row of at least min_q_len tokens."""
    block_q = 128 // group
    items = {}
    for seq, (q_len, total) in enumerate(zip(query_lens, seq_lens)):
        if q_len < max(min_q_len, 1):
            continue
        for first in range(0, q_len, block_q):
            items[(seq, first)] = (math.ceil((total - q_len) / block_n)
                                   + math.ceil(min(first + block_q, q_len) / block_n))
    return items


@pytest.mark.parametrize("group", [2, 4, 8])
@pytest.mark.parametrize("min_q_len", [2, 16, 64])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("order", ["rows", "keys"])
def test_plan_tiles_lists_every_tile_once_in_its_order(group, min_q_len, seed, order):
    rng = random.Random(seed * 31 + group + min_q_len)
    query_lens = [rng.choice([1, 1, 5, 16, 33, 200, 900, rng.randint(2, 2000)]) for _ in range(rng.randint(1, 40))]
    seq_lens = [q + rng.choice([0, 0, 15, 700, rng.randint(0, 5000)]) for q in query_lens]
    plan = prefill_gluon.plan_tiles(query_lens, seq_lens, group, min_q_len, block_n=128, order=order)
    want = brute_force(query_lens, seq_lens, group, min_q_len, 128)
    got = [tuple(map(int, item)) for item in plan]
    assert plan.dtype == np.int32 and plan.shape == (len(want), 2)
    assert sorted(got) == sorted(want), "each tile of each row at least min_q_len long, once"
    if order == "keys":
        work = [want[item] for item in got]
        assert work == sorted(work, reverse=True), "the items with the most key tiles first"
    else:
        assert got == sorted(got, key=lambda item: (item[0], -item[1])), "row by row, each row's tiles counted down"


def test_plan_tiles_by_default_counts_each_rows_tiles_down_row_by_row():
    """The backend's order (the full grid's), spelled out."""
    query_lens, seq_lens = [200, 1, 900, 40], [900, 901, 900, 40]
    plan = prefill_gluon.plan_tiles(query_lens, seq_lens, 4, 16)
    want = [(0, f) for f in (192, 160, 128, 96, 64, 32, 0)] + [(2, f) for f in range(896, -1, -32)] + [(3, 32), (3, 0)]
    assert [tuple(map(int, item)) for item in plan] == want
    with pytest.raises(ValueError, match="order"):
        prefill_gluon.plan_tiles(query_lens, seq_lens, 4, order="heads")


def test_plan_tiles_of_no_row_long_enough_is_empty():
    plan = prefill_gluon.plan_tiles([1, 1, 7], [900, 20, 7], 4, min_q_len=16)
    assert plan.shape == (0, 2)


def _step_meta(query_lens, seq_lens):
    from kvserve.attention.metadata import AttentionMetadata
    n = len(query_lens)
    return AttentionMetadata(num_seqs=n, num_tokens=sum(query_lens), block_size=16,
                             query_start_loc=torch.zeros(n + 1), seq_lens=torch.zeros(n), block_tables=[],
                             slot_mappings=[], max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                             query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)


def test_backend_plans_once_a_step_per_bound():
    """Every layer of a step asks; the list is planned and uploaded once per min_q_len
    (a 200- and a 900-token chunk beside 128 decodes: the grid would be mostly idle)."""
    from kvserve.attention.triton_backend import gluon_tile_list
    query_lens, seq_lens = [200] + [1] * 128 + [900], [900] + [901] * 128 + [900]
    meta = _step_meta(query_lens, seq_lens)
    q, kv_cache = torch.empty(sum(query_lens), 32, 128), torch.empty(2, 4, 16, 8, 128)
    first = gluon_tile_list(meta, q, kv_cache)(16)
    assert gluon_tile_list(meta, q, kv_cache)(16) is first
    assert sorted(map(tuple, first.tolist())) == sorted(brute_force(query_lens, seq_lens, 4, 16, 128))
    assert gluon_tile_list(meta, q, kv_cache)(300).shape == (29, 2)   # only the 900-token row


def test_backend_plans_nothing_where_the_grid_is_taken(monkeypatch):
    """Where the launch takes its full grid (`takes_list` on the host lengths), the step gets
    None and no list is planned or uploaded (the kernel would drop it)."""
    from kvserve.attention.triton_backend import gluon_tile_list

    def no_plan(*args, **kwargs):
        raise AssertionError("planned a list the launch does not take")
    monkeypatch.setattr(prefill_gluon, "plan_tiles", no_plan)
    meta = _step_meta([200, 1, 900], [900, 901, 900])
    q, kv_cache = torch.empty(1101, 32, 128), torch.empty(2, 4, 16, 8, 128)
    assert gluon_tile_list(meta, q, kv_cache)(16) is None
    assert gluon_tile_list(meta, q, kv_cache)(16) is None   # decided once, kept like a list


def test_count_tiles_is_the_plans_length():
    rng = np.random.default_rng(3)
    for _ in range(50):
        query_lens = rng.integers(1, 700, size=int(rng.integers(1, 40))).tolist()
        seq_lens = [n + int(rng.integers(0, 900)) for n in query_lens]
        for group, min_q_len in ((4, 2), (8, 64), (2, 300)):
            plan = prefill_gluon.plan_tiles(query_lens, seq_lens, group, min_q_len)
            assert prefill_gluon.count_tiles(query_lens, group, min_q_len) == plan.shape[0]


def test_list_taken_where_the_full_grid_mostly_idles():
    """The launches measured on an H100 (LIST_MIN_SAVING's comment): the list where the grid
    has 17x and 4.2x its programs, the grid where none of its programs idle."""
    def launch(rows):
        plan = prefill_gluon.plan_tiles([n for _, n in rows], [p + n for p, n in rows], 4)
        return prefill_gluon.takes_list(max(n for _, n in rows), len(rows), 4, plan.shape[0])
    decodes = [(899, 1)] * 128
    assert launch([(700, 200)] * 20 + [(0, 900)] * 4 + decodes)
    assert launch([(700, 200)] * 40 + decodes)
    assert not launch([(0, 900)] * 9) and not launch([(0, 1024)] * 8) and not launch([(0, 8192)])
    assert not launch([(700, 200)] * 40)
