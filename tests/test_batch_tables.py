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
