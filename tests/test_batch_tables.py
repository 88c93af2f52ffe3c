"""Block tables padded for the device: against a plain-Python padding."""
import random

import torch

from kvserve.runner.batch import pad_tables


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


def test_block_table_rows_gather_equals_padded_lists_through_growth_and_release():
    """Random appends, nulls and releases past the initial rows and width:
    every gather equals the brute-force padding of a dict of lists."""
    import random

    from kvserve.cache.block_table_rows import BlockTableRows
    rng, rows, truth = random.Random(0), BlockTableRows(num_groups=2, rows=2, width=2), {}
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
                width = max(1, max(len(truth[r][group]) for r in ids))
                assert got.tolist() == _brute([truth[r][group] for r in ids], width)
