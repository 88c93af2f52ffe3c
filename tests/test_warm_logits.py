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


def test_every_row_count_once(runner, monkeypatch):
    seen = []
    compute = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: seen.append(h) or compute(h))
    runner.warm_logits(7)
    weight = runner.model.lm_head.weight
    assert [h.shape[0] for h in seen] == list(range(1, 8))
    assert all(h.shape[1] == weight.shape[1] and h.dtype == weight.dtype and h.is_contiguous() for h in seen)
