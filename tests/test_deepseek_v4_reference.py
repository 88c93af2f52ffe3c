"""DeepSeek V4 against the float64 reference written from the definitions
(tests/v4_reference.py), including the CSA configuration on which
transformers' cached generate and uncached forward disagree
(docs/deepseek_v4.md: the indexer's top-k ties)."""
from __future__ import annotations

import pytest
import torch

from kvserve.model.deepseek_v4.generate import greedy_generate
from kvserve.model.deepseek_v4.loader import load_deepseek_v4
from tests.v4_reference import Reference
from tests.v4_tiny import CSA, HCA, SLIDING, one_thread, tiny_v4_model  # noqa: F401 (one_thread: autouse)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("types, overrides", [([SLIDING, HCA], {}), ([CSA, HCA], {"index_n_heads": 16})])
def test_reference_matches_transformers_without_ties(types, overrides):
    hf = tiny_v4_model(types, **overrides)
    ids = _ids(30, 3)
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), use_cache=False).logits[0].double()
    torch.testing.assert_close(Reference(hf).logits(ids), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def csa_pair(tmp_path_factory):
    """The 2-layer CSA-only config with sliding window 8 and 2 indexer heads:
    many index scores are exactly 0 (every head's ReLU is 0), so top-k ties."""
    path = tmp_path_factory.mktemp("v4csa")
    hf = tiny_v4_model([CSA, CSA])
    hf.save_pretrained(path)
    return hf, load_deepseek_v4(str(path))


def test_transformers_uncached_forward_is_not_causal_on_ties(csa_pair):
    """The pitfall itself: HF's logits at positions < 20 change when tokens
    20..39 are appended (torch.topk breaks ties by vector length); ours do not."""
    hf, ours = csa_pair
    ids = _ids(40, 1)
    with torch.no_grad():
        long, short = (hf(torch.tensor([x]), use_cache=False).logits[0] for x in (ids, ids[:20]))
    assert (long[:20] - short).abs().max() > 1e-2
    torch.testing.assert_close(ours.full_logits(ids)[:20], ours.full_logits(ids[:20]), atol=1e-5, rtol=1e-5)


def test_csa_matches_float64_reference(csa_pair):
    hf, ours = csa_pair
    ref = Reference(hf)
    ids = _ids(30, 0)
    torch.testing.assert_close(ours.full_logits(ids).double(), ref.logits(ids), atol=1e-4, rtol=1e-4)
    prompts = [_ids(n, n) for n in (3, 17)]
    expected = [ref.greedy(p, 12) for p in prompts]
    for chunk in (5, 13):
        assert greedy_generate(ours, prompts, 12, chunk) == expected
