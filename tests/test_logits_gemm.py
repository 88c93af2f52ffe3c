"""The lm_head product in column blocks (model/logits_gemm.py): the same logits as one product,
the plan's bucket lookup, tuning over the candidates, and the model consulting its plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.backend import get_backend
from kvserve.model import llama, logits_gemm
from kvserve.model.loaders import build_model, resolve_model
from kvserve.model.logits_gemm import LogitsPlan, blocked_linear


@pytest.mark.parametrize("rows", [0, 1, 7, 300, 999, 1000, 5000])
def test_blocks_give_the_one_product(rows):
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 64, dtype=torch.float64), torch.randn(1000, 64, dtype=torch.float64)
    out = blocked_linear(hidden, weight, rows)
    assert out.shape == (5, 1000)
    torch.testing.assert_close(out, F.linear(hidden, weight), rtol=1e-12, atol=1e-12)


def test_plan_takes_the_smallest_bucket_holding_the_batch():
    plan = LogitsPlan({64: 200, 1: 0, 8: 300})
    assert [plan.rows_for(m) for m in (1, 2, 8, 9, 64, 65, 10_000)] == [0, 300, 300, 200, 200, 0, 0]
    assert LogitsPlan().rows_for(3) == 0


def test_tune_times_each_candidate_at_each_bucket(monkeypatch):
    monkeypatch.setattr(logits_gemm, "CANDIDATE_ROWS", (0, 128, 300, 4096))
    plan = LogitsPlan.tune(torch.randn(1000, 32), max_rows=20, reps=2)
    assert list(plan.rows_by_bucket) == [1, 2, 4, 8, 16, 24]  # 24: the bucket holding 20
    for m, timings in plan.timings_ms.items():
        assert set(timings) == {0, 128, 300}  # 4096 rows would be one product again
        assert plan.rows_by_bucket[m] == min(timings, key=timings.get)
    assert "M<=24" in plan.describe()


def test_model_logits_follow_its_plan(monkeypatch):
    resolved = resolve_model("dummy:tiny-llama")
    config = resolved.config
    model = build_model(config, get_backend("torch"), [0] * config.num_hidden_layers)
    resolved.weights.load_into(model)
    hidden = torch.randn(3, config.hidden_size)
    expected = model.compute_logits(hidden)
    model.logits_plan = LogitsPlan({4: 50})
    seen = []
    monkeypatch.setattr(llama, "blocked_linear",
                        lambda h, w, rows: seen.append(rows) or blocked_linear(h, w, rows))
    logits = model.compute_logits(hidden)
    assert seen == [50] and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected)
    model.tune_logits(8)
    assert set(model.logits_plan.rows_by_bucket) == {1, 2, 4, 8}
