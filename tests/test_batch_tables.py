"""Block tables padded for the device: against a plain-Python padding."""
import random

import pytest
import torch

from kvserve.runner.batch import pad_tables, slot_mapping
from kvserve.runner.staging import ALIGN, StagingRing


def _brute(tables, width):
    return [t + [0] * (width - len(t)) for t in tables]


def test_pad_tables_matches_plain_padding():
    rng = random.Random(0)
    for _ in range(50):
        tables = [[rng.randint(1, 10**6) for _ in range(rng.choice([0, 1, rng.randint(1, 70)]))]
                  for _ in range(rng.randint(1, 20))]
        width = max(max(map(len, tables)), 1)
        got = pad_tables(tables)
        assert got.dtype == torch.int32 and got.tolist() == _brute(tables, width)
        assert pad_tables(tables, width + 3).tolist() == _brute(tables, width + 3)


def test_pad_tables_of_empty_rows_has_one_null_column():
    assert pad_tables([[], []]).tolist() == [[0], [0]]
    assert tuple(pad_tables([]).shape) == (0, 1)   # no rows at all (not an error)


def _check_gather(got: torch.Tensor, tables: list[list[int]], max_width: int | None) -> None:
    """`got` is `tables` padded with the null block to a width that, without
    `max_width`, is the longest's (at least 1); with it, a multiple of 16 or
    `max_width` itself, never past `max_width` unless a table is longer."""
    longest = max(1, max(map(len, tables)))
    width = got.shape[1]
    assert got.tolist() == _brute(tables, width)
    if max_width is None or longest >= max_width:
        assert width == longest, (width, longest, max_width)
    else:
        assert longest <= width <= max_width, (width, longest, max_width)
        assert width % 16 == 0 or width == max_width, (width, max_width)


@pytest.mark.parametrize("max_width", [None, 37, 64])
def test_block_table_rows_gather_equals_padded_lists_through_growth_and_release(max_width):
    """Random appends, nulls and releases past the initial rows and width:
    every gather equals the brute-force padding of a dict of lists, as wide
    as `_check_gather` says."""
    import random

    from kvserve.cache.block_table_rows import BlockTableRows
    rng, rows, truth = random.Random(0), BlockTableRows(num_groups=2, rows=2, width=2, max_width=max_width), {}
    for step in range(400):
        rid = f"r{rng.randrange(12)}"
        action = rng.random()
        if action < 0.15 and rid in truth:
            rows.release(rid)
            del truth[rid]
        elif action < 0.3 and rid in truth and truth[rid][1]:
            index = rng.randrange(len(truth[rid][1]))
            rows.set_null(rid, 1, index)
            truth[rid][1][index] = 0
        else:
            tables = truth.setdefault(rid, [[], []])
            group = rng.randrange(2)
            new = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 5))]
            rows.append(rid, group, len(tables[group]), new)
            tables[group].extend(new)
        if truth:
            ids = rng.sample(sorted(truth), rng.randrange(1, len(truth) + 1))
            for group, got in enumerate(rows.gather(ids)):
                _check_gather(got, [truth[r][group] for r in ids], max_width)


@pytest.mark.parametrize("max_width", [None, 40])
def test_block_table_rows_gather_of_the_same_batch_follows_rows_changing_hands(max_width):
    """The same batch gathered step after step (its rows are remembered)
    while its requests are released and re-added and others take the freed
    rows: every gather equals the brute-force padding."""
    import random

    from kvserve.cache.block_table_rows import BlockTableRows
    rng, rows, truth = random.Random(1), BlockTableRows(num_groups=1, rows=2, width=2, max_width=max_width), {}
    batch = [f"r{i}" for i in range(6)]
    for step in range(300):
        for _ in range(rng.randrange(1, 5)):  # a request may leave and come back between gathers
            rid = f"r{rng.randrange(10)}"
            if rng.random() < 0.3 and rid in truth:
                rows.release(rid)
                del truth[rid]
            else:
                new = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 3))]
                start = len(truth.setdefault(rid, [[]])[0])
                if len(new) == 1:  # a decode step opening a block
                    rows.append_one(rid, 0, start, new[0])
                else:
                    rows.append(rid, 0, start, new)
                truth[rid][0].extend(new)
        ids = [r for r in batch if r in truth]
        if ids:
            _check_gather(rows.gather(list(ids))[0], [truth[r][0] for r in ids], max_width)


@pytest.mark.parametrize("max_width", [None, 48])
def test_a_streak_s_rows_less_those_that_left_are_gathered_from_the_last_batch(max_width, monkeypatch):
    """Step after step, some rows leave the batch (their request idles, or
    finishes and is released before or after the gather) and the rest grow:
    each gather names the rows it keeps of the last step's id list
    (`previous_rows`) and equals the padding of the lists, built from the last
    batch's rows: padded, a new batch comes only when the longest table passes
    the batch's width (at most once here, at 32 columns); exact, whenever it grows."""
    import numpy as np

    from kvserve.cache.block_table_rows import BlockTableRows
    rng, rows, truth = random.Random(7), BlockTableRows(1, rows=4, max_width=max_width), {}
    for i in range(40):
        truth[f"r{i}"] = [rng.randrange(1, 999) for _ in range(rng.randrange(1, 30))]
        rows.append(f"r{i}", 0, 0, truth[f"r{i}"])
    built = []
    new_batch = rows._new_batch
    monkeypatch.setattr(rows, "_new_batch", lambda ids: built.append(ids) or new_batch(ids))
    ids = sorted(truth)
    _check_gather(rows.gather(ids)[0], [truth[r] for r in ids], max_width)
    released_late = []
    for step in range(30):
        for rid in released_late:
            rows.release(rid)
        kept = np.array(sorted(rng.sample(range(len(ids)), len(ids) - rng.randrange(0, 3))), dtype=np.int64)
        left = [ids[i] for i in range(len(ids)) if i not in set(kept.tolist())]
        early = [r for r in left if rng.random() < 0.5]
        for rid in early:                 # finished and released before this step's gather
            rows.release(rid)
        released_late = [r for r in left if r not in early]   # idle now, released after it
        previous, ids = ids, [ids[i] for i in kept]
        for rid in ids:                   # each row one token further: sometimes a block more
            if rng.random() < 0.2:
                truth[rid].append(rng.randrange(1, 999))
                rows.append_one(rid, 0, len(truth[rid]) - 1, truth[rid][-1])
        _check_gather(rows.gather(ids, (previous, kept))[0], [truth[r] for r in ids], max_width)
    for rid in released_late:
        rows.release(rid)
    again = len(built)
    _check_gather(rows.gather(ids)[0], [truth[r] for r in ids], max_width)   # a steady step after
    assert len(built) == again   # the kept batch stayed current
    if max_width is not None:
        assert len(built) <= 2, len(built)
    rows.release(ids[0])
    with pytest.raises(KeyError):   # a released request has no row: the batch no longer stands
        rows.gather(ids)


def test_a_padded_batch_keeps_its_width_until_a_table_passes_it():
    """Decode steps grow one table a block at a time: the padded batch (and
    so the staging ring's layout) keeps one width for 16 blocks, where an
    exact one changes at every block; a long prompt's table, appended at
    once, still gets all its padded columns."""
    from kvserve.cache.block_table_rows import BlockTableRows
    padded, exact = BlockTableRows(1, max_width=1000), BlockTableRows(1)
    for rows in (padded, exact):
        rows.append("a", 0, 0, [7] * 3)
        rows.append("b", 0, 0, [5] * 700)
    widths = {"padded": set(), "exact": set()}
    for index in range(3, 40):
        for name, rows in (("padded", padded), ("exact", exact)):
            rows.append_one("a", 0, index, index)
            widths[name].add(rows.gather(["a"])[0].shape[1])
    assert widths["padded"] == {16, 32, 48} and len(widths["exact"]) == 37
    got = padded.gather(["a", "b"])[0]
    assert got.shape == (2, 704) and got[1, :700].eq(5).all() and got[1, 700:].eq(0).all()
    capped = BlockTableRows(1, max_width=37)   # max_model_len in blocks: a graph's table holds no more
    capped.append("a", 0, 0, [3] * 34)
    assert capped.gather(["a"])[0].shape == (1, 37)


def test_block_table_rows_gather_after_a_batch_request_changed_rows():
    """A request leaves, another takes its row, it comes back in a new one:
    the same batch gathered again reads the new row."""
    from kvserve.cache.block_table_rows import BlockTableRows
    rows = BlockTableRows(num_groups=1, rows=4, width=2)
    rows.append("a", 0, 0, [1])
    rows.append("b", 0, 0, [2, 3])
    assert rows.gather(["a", "b"])[0].tolist() == [[1, 0], [2, 3]]
    rows.release("a")
    rows.append("c", 0, 0, [9, 9])   # the row "a" left
    rows.append("a", 0, 0, [4])
    assert rows.gather(["a", "b"])[0].tolist() == [[4, 0], [2, 3]]


class FakeEvent:
    """A CUDA event's record/synchronize, logged (the CPU ring's copies are synchronous)."""
    recorded = 0
    waited: list[int] = []

    def record(self, stream=None):
        self.id, FakeEvent.recorded = FakeEvent.recorded, FakeEvent.recorded + 1

    def synchronize(self):
        FakeEvent.waited.append(self.id)


def cpu_ring() -> StagingRing:
    """A ring whose "device" buffers are on the CPU: the CUDA path's packing,
    layouts and reuse, checkable here."""
    FakeEvent.recorded, FakeEvent.waited = 0, []
    return StagingRing(torch.device("cpu"), pin_memory=False, event=FakeEvent)


def mixed_parts(rng: torch.Generator, scale: int = 1) -> list[torch.Tensor]:
    shapes = [(1,), (17 * scale,), (0,), (5, 3), (ALIGN,), (3, 40 * scale), (7,)]
    dtypes = [torch.int32, torch.int64, torch.int32, torch.int64, torch.int32, torch.int32, torch.int64]
    parts = [torch.randint(0, 1 << 30, shape, generator=rng, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    parts.append(torch.tensor([True, False, True]))  # 3 bytes: the next start still aligns
    parts.append(torch.arange(5, dtype=torch.int64))
    return parts


def test_uploaded_parts_come_back_equal_and_aligned():
    """One upload's pack and split: parts of mixed dtypes and odd byte lengths,
    empty ones, 2-D ones, in any order, as views of the slot's device buffer."""
    ring = cpu_ring()
    parts = mixed_parts(torch.Generator().manual_seed(0))
    views = ring.upload(parts)
    _, device_buffer = ring.buffers(0)
    for part, view in zip(parts, views):
        assert view.dtype == part.dtype and view.shape == part.shape and torch.equal(view, part)
        assert view.is_contiguous() and view.data_ptr() % 16 == 0
        assert view.untyped_storage().data_ptr() == device_buffer.untyped_storage().data_ptr()


def test_a_slot_reuses_its_views_for_the_same_layout_and_rewrites_their_values():
    """Steady decode: the same dtypes and shapes every step. The slot's views
    come back (no tensor built), holding each upload's own values; a new
    layout gets new views; and every upload's views still hold its parts
    while the other slots take the next SLOTS - 1 uploads."""
    ring, rng = cpu_ring(), torch.Generator().manual_seed(3)
    first, recent = {}, []
    for step in range(4 * StagingRing.SLOTS):
        parts = mixed_parts(rng, scale=1 + (step // (2 * StagingRing.SLOTS)))
        views = ring.upload(parts)
        slot = step % StagingRing.SLOTS
        same_layout = slot in first and first[slot][0] == [p.shape for p in parts]
        recent = [*recent[-(StagingRing.SLOTS - 2):], (parts, views)]   # the last SLOTS - 1 uploads
        assert all(all(map(torch.equal, v, p)) for p, v in recent)
        if same_layout:
            assert all(a is b for a, b in zip(views, first[slot][1]))
        else:
            first[slot] = ([p.shape for p in parts], views)
    assert sum(1 for shapes, _ in first.values() if shapes[1] == torch.Size([34])) == StagingRing.SLOTS


def test_slot_mapping_matches_a_per_token_walk():
    rng = random.Random(1)
    block_size, tables = 4, [[rng.randrange(1, 99) for _ in range(6)] for _ in range(3)]
    seq_idx = [rng.randrange(3) for _ in range(40)]
    positions = [rng.randrange(24) for _ in range(40)]
    got = slot_mapping(pad_tables(tables), torch.tensor(seq_idx), torch.tensor(positions), block_size)
    want = [tables[s][p // block_size] * block_size + p % block_size for s, p in zip(seq_idx, positions)]
    assert got.dtype == torch.int64 and got.tolist() == want


def test_a_new_row_count_slices_the_layout_of_its_capacity():
    """Decode-shaped uploads whose row count changes every step (a request finishing
    each): counts of one power-of-two capacity share each slot's layout, every view
    the first rows of the same memory, holding the new values; a count the slot met
    before takes the same views; a count past the capacity, or a wider table, gets
    a layout of its own; every view is 16-byte aligned."""
    ring, rng = cpu_ring(), torch.Generator().manual_seed(4)
    builds, build = [], ring._build
    ring._build = lambda slot, key: builds.append(slot) or build(slot, key)

    def upload(rows: int, width: int = 40) -> list[torch.Tensor]:
        parts = [torch.randint(0, 99, shape, generator=rng, dtype=dtype) for shape, dtype in
                 (((rows,), torch.int64), ((rows + 1,), torch.int32), ((rows, width), torch.int32))]
        views = ring.upload(parts)
        assert all(map(torch.equal, views, parts)) and [v.shape for v in views] == [p.shape for p in parts]
        return views
    first = [upload(255 - i) for i in range(StagingRing.SLOTS)]          # rows 255..248, qsl 256..249
    again = [upload(247 - i) for i in range(StagingRing.SLOTS)]
    assert builds == list(range(StagingRing.SLOTS))   # each slot's capacity layout made once, then kept
    for views in first:   # each part starts past the capacity (256 rows) of the one before it
        assert views[1].data_ptr() - views[0].data_ptr() == 256 * 8
        assert views[2].data_ptr() - views[1].data_ptr() == 256 * 4
    for old, new in zip(first, again):   # slot by slot: capacity 256 throughout
        assert [v.data_ptr() for v in old] == [v.data_ptr() for v in new]
    back = [upload(255 - i) for i in range(StagingRing.SLOTS)]   # counts each slot met: its views again
    assert all(a is b for old, new in zip(first, back) for a, b in zip(old, new))
    past = [upload(256) for _ in range(StagingRing.SLOTS)]   # qsl 257: capacity 512, the table further on
    wider = [upload(247, 56) for _ in range(StagingRing.SLOTS)]
    for old, new, other in zip(again, past, wider):
        assert old[2].data_ptr() - old[0].data_ptr() < new[2].data_ptr() - new[0].data_ptr()
        assert other[2].shape == (247, 56)
    assert all(v.data_ptr() % 16 == 0 for views in first + again + past + wider for v in views)


def test_uploads_inside_and_outside_inference_mode_share_a_ring():
    """The engine uploads under inference mode; a test or a worker may not. A
    slot laid out under it is written again outside it, and the other way round."""
    ring, rng = cpu_ring(), torch.Generator().manual_seed(5)
    for step in range(3 * StagingRing.SLOTS):
        parts = [torch.randint(0, 99, (9,), generator=rng), torch.randint(0, 99, (2, 3), generator=rng)]
        with torch.inference_mode(step % 3 == 0):
            views = ring.upload(parts)
        assert all(map(torch.equal, views, parts))


def test_staging_ring_reuses_a_buffer_only_after_its_copy_and_grows_rarely():
    """Eight uploads a slot, each 8,000 bytes larger than the step before (a table that
    widens: its rows' capacity rounding does not apply to its width, so the sizes grow
    linearly): each slot's buffers are replaced only when too small, by ones of twice
    their size or more, not once an upload."""
    ring = cpu_ring()
    sizes = {}
    for step in range(8 * StagingRing.SLOTS):
        parts = [torch.zeros(2, 125 * (step + 1), dtype=torch.int32)]   # 16 rows' capacity: 8,000 B a step
        slot, layout = ring.take(parts)
        assert layout.host_bytes.numel() >= 8000 * (step + 1)
        assert slot == step % StagingRing.SLOTS
        # the slot's last copy (the step SLOTS back) is waited for before its buffer is reused
        assert FakeEvent.waited == list(range(max(0, step - StagingRing.SLOTS + 1)))
        host, device = ring.buffers(slot)
        assert host.numel() == device.numel()
        sizes.setdefault(slot, []).append(host.numel())
        ring.copied(slot)
    for grown in sizes.values():   # slot 0: 8,000, then 72,000 (a step 8 uploads on), 144,000, 288,000, 576,000
        changes = [b for a, b in zip(grown, grown[1:]) if b != a]
        assert all(b >= 2 * a for a, b in zip(grown, grown[1:]) if b != a) and len(changes) <= 4, grown


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uploads_through_the_staging_ring_arrive_intact():
    """More uploads than the ring has slots, each of a new size, with the device busy
    in between: every upload's device copy equals what was packed."""
    from kvserve.runner.staging import upload_packed
    rng = torch.Generator().manual_seed(2)
    busy = torch.randn(4096, 4096, device="cuda")
    sent, got = [], []
    for step in range(3 * StagingRing.SLOTS):
        # new sizes, then steady ones (the slots' reused layouts)
        n = step * 97 + 1 if step < StagingRing.SLOTS + 3 else 7
        parts = [torch.randint(0, 1 << 30, shape, generator=rng, dtype=dtype)
                 for shape, dtype in (((n,), torch.int64), ((5,), torch.int32), ((3, n), torch.int32))]
        busy = busy @ busy / 4096   # keeps the stream busy, so copies queue behind it
        views = upload_packed(parts, torch.device("cuda"))
        # each upload's views read on the device, in stream order, before the slot comes round again
        flat = torch.cat([v.reshape(-1).long() for v in views])
        got.append([torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True).copy_(flat, non_blocking=True)])
        sent.append(parts)
    torch.cuda.synchronize()
    for parts, (flat,) in zip(sent, got):
        assert flat.tolist() == torch.cat([p.reshape(-1).long() for p in parts]).tolist()


def test_the_engine_pads_its_batch_tables_within_max_model_len_and_decodes_the_same():
    """An engine's step tables are padded to multiples of 16 columns, never
    past max_model_len in blocks (90 tokens of 4: 23, a graph's table width),
    and its greedy tokens equal those of the same engine with exact widths."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 5 * i + 2))} for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs, widths = [], {}
    for max_width in (23, None):
        llm = LLM("dummy:tiny-llama", load_format="dummy", device="cpu", dtype="float32", block_size=4,
                  max_model_len=90, max_num_seqs=8, seed=0)
        kv = llm.engine.kv_cache
        rows = kv._held.rows
        assert rows.max_width == 23
        rows.max_width = max_width
        seen = widths[max_width] = set()
        block_tables = kv.block_tables
        kv.block_tables = lambda *args: [seen.add(t.shape[1]) or t for t in block_tables(*args)]
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1] and all(len(o) == 40 for o in outputs[0])
    assert widths[23] <= {16, 23} and 23 in widths[23], widths
    assert len(widths[None]) > 5, widths


def test_rows_are_taken_lowest_first_and_the_table_grows_only_when_all_are_held():
    """Four rows for eight requests: one doubling, after which every new row is used before
    the next (a growth that freed only some of its rows would double again at the sixth)."""
    from kvserve.cache.block_table_rows import BlockTableRows
    rows = BlockTableRows(num_groups=1, rows=4)
    assert [rows.row(str(i)) for i in range(8)] == list(range(8))
    assert rows._tables[0].shape[0] == 8
    rows.release("2")
    assert rows.row("new") == 2 and rows._tables[0].shape[0] == 8
