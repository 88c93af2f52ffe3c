"""benchmarks/v4_launch_variants.py: the V4 kernel builds a growing context asks for.

A served prompt's context grows chunk by chunk; each launch signature it meets for the first time
compiles inside that step (a 64K-token prompt's prefill took 36.4 s on a cold Triton cache and
1.3 s on a warm one, on an H100). The indexer's score rows are as wide as the context: unless
their width keeps the stride a multiple of 16, Triton builds the score and top-k kernels twice
over for that alone.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import v4_launch_variants as lv  # noqa: E402

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
