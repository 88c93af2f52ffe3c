"""`ModelRunner.warm_logits` launches the logits GEMM at every row count a step can
sample, 1..max_num_seqs, in the weight's dtype and width: cuBLAS picks its kernel by
the row count, and a kernel first launched mid-traffic, with the device busy, held
the host ~76 ms on the H200's host (benchmarks/gemm_first_use_probe.py)."""
from __future__ import annotations

import pytest

from kvserve import LLM
from tests.tiny_models import save_tiny_checkpoint


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    ckpt = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama") / "ckpt")
    return LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=256).engine.runner


@pytest.fixture(scope="module")
def v4_runner():
    return LLM("dummy:tiny-deepseek-v4", dtype="float32", device="cpu", max_model_len=256).engine.runner


def _rows_warmed(runner, monkeypatch, max_rows: int) -> list[int]:
    seen = []
    compute = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: seen.append(h) or compute(h))
    runner.warm_logits(max_rows)
    weight = runner.logits_weight()
    assert all(h.shape[1] == weight.shape[1] and h.dtype == weight.dtype and h.is_contiguous() for h in seen)
    return [h.shape[0] for h in seen]


def test_every_row_count_once(runner, monkeypatch):
    assert runner.logits_weight() is runner.model.lm_head.weight
    assert _rows_warmed(runner, monkeypatch, 7) == list(range(1, 8))


def test_deepseek_v4_warms_its_head(v4_runner, monkeypatch):
    """V4's output projection is `head`; its runner names it."""
    assert v4_runner.logits_weight() is v4_runner.model.head.weight
    assert _rows_warmed(v4_runner, monkeypatch, 3) == [1, 2, 3]
