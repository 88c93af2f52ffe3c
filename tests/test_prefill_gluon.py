"""The TMA path's Gluon kernel (kvserve/attention/kernels/prefill_gluon.py) against the torch
reference, as tests/test_triton_kernels.py checks the Triton kernels: fresh random bf16
inputs, the cache NaN-filled outside what was written (NULL block and slots past each
sequence's end), NaN-poisoned output, float32 reference, the largest error of any (sequence,
head) under TOL. GPU only (Hopper: wgmma and TMA); each test also proves the Gluon kernel ran.
"""
from __future__ import annotations

import pytest
import torch

from kvserve.cache.specs import FullAttentionSpec
from tests.test_triton_kernels import (TMA_FRESH_STEP, TMA_STEP, TOL, _spy_tma, backend_forward_err,
                                       check_attention)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")]

# TMA_STEP plus a chunk of exactly a page after a prefix that ends mid-page, a chunk ending
# exactly at a key tile, and one shorter than a page after a prefix (the paged kernel's:
# the Gluon kernel's prefix tiles read whole pages).
GLUON_STEP = TMA_STEP + [(1000, 16), (128, 128), (33, 7)]
# The served mixed burst's ragged step (7 fresh prompts, 7,950 tokens) and a long prefix.
BURST_STEP = [(0, n) for n in (4313, 1099, 812, 640, 555, 301, 230)]
LONG_PREFIX_STEP = [(7000, 2100), (0, 1), (2047, 129)]
IDE_STEP = [(700, 200)] * 6 + [(0, 900)] * 2 + [(899, 1)] * 16 + [(650, 177), (0, 61)]


def _gluon_taken(monkeypatch) -> list[bool]:
    from kvserve.attention.kernels import mixed
    calls = _spy_tma(monkeypatch, gluon=True)
    monkeypatch.setattr(mixed, "prefill_attention_tma", lambda *a, **kw: pytest.fail("Triton TMA kernel taken"))
    return calls


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 8), (64, 8)], ids=["group4", "group2", "group8"])
def test_gluon_prefill_with_prefixes_matches_reference(block_size, heads, kv_heads, monkeypatch):
    """Chunks after cached prefixes (pages through the block table), fresh prompts, decodes
    beside them; chunks shorter than a page go to the paged kernel."""
    calls = _gluon_taken(monkeypatch)
    err = check_attention(GLUON_STEP, FullAttentionSpec(), block_size, heads=heads, kv_heads=kv_heads,
                          seed=block_size + heads, fresh_kv=True, paged_below=block_size)
    assert calls == [True]
    assert err < TOL


@pytest.mark.parametrize("listed", [True, False], ids=["work list", "full grid"])
def test_gluon_prefill_short_chunks_beside_whole_prompts(listed, monkeypatch):
    """The step whose full grid was mostly empty programs (the ide-completion scenario's prefill:
    chunks after cached prefixes, whole prompts, decodes): the work list, as the backend
    launches it, and the full grid, as launches without host lengths do."""
    calls = _gluon_taken(monkeypatch)
    err = check_attention(IDE_STEP, FullAttentionSpec(), 16, heads=32, kv_heads=8, seed=3 + listed,
                          fresh_kv=True, paged_below=16, listed=listed)
    assert calls == [True]
    assert err < TOL


@pytest.mark.parametrize("seqs", [TMA_FRESH_STEP, BURST_STEP], ids=["fresh", "burst"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_gluon_prefill_fresh_prompts_match_reference(seqs, block_size, monkeypatch):
    """Fresh prompts: the build without the prefix loop, every chunk length its own."""
    calls = _gluon_taken(monkeypatch)
    err = check_attention(seqs, FullAttentionSpec(), block_size, heads=32, kv_heads=8, seed=block_size + 5,
                          fresh_kv=True, cached_prefixes=False)
    assert calls == [False]
    assert err < TOL


def test_gluon_prefill_long_prefix(monkeypatch):
    calls = _gluon_taken(monkeypatch)
    err = check_attention(LONG_PREFIX_STEP, FullAttentionSpec(), 16, heads=32, kv_heads=8, seed=11,
                          fresh_kv=True, paged_below=16)
    assert calls == [True]
    assert err < TOL


def test_short_chunks_after_prefixes_keep_the_triton_kernel(monkeypatch):
    """With cached prefixes and no promise that chunks shorter than a page go elsewhere, the
    Triton TMA kernel runs the step: the Gluon one would read slots never written this step."""
    from kvserve.attention.kernels import mixed
    real_gluon, real_triton, triton_calls = mixed.gluon_prefill, mixed.prefill_attention_tma, []
    monkeypatch.setattr(mixed, "gluon_prefill", lambda *a: real_gluon(*a) and (
        lambda *args, **kw: pytest.fail("Gluon kernel taken")))
    monkeypatch.setattr(mixed, "prefill_attention_tma",
                        lambda *a, **kw: triton_calls.append(kw["cached_prefixes"]) or real_triton(*a, **kw))
    err = check_attention(GLUON_STEP, FullAttentionSpec(), 16, heads=32, kv_heads=8, seed=3, fresh_kv=True)
    assert triton_calls == [True] and err < TOL


def test_backend_runs_the_gluon_kernel_with_prefixes(monkeypatch):
    """Through the backend: the step's short chunks go to the paged kernel
    (`short_chunk_bound`), the rest to the Gluon kernel; all match the reference."""
    calls = _gluon_taken(monkeypatch)
    err = backend_forward_err(GLUON_STEP, seed=9)
    assert calls == [True]
    assert err < TOL


@pytest.mark.parametrize("seqs", [[(3000, 1200), (0, 900), (7000, 1)], [(0, 1024)] * 3],
                         ids=["prefix-heavy", "short-chunks"])
def test_gluon_takes_the_steps_the_triton_gates_keep_paged(seqs, monkeypatch):
    """Steps mostly over cached prefixes, or of short chunks only, keep the paged kernel under the
    Triton kernel's gates (tests/test_triton_kernels.py); the Gluon kernel has none
    (`mixed.tma_gates`): they take it, and match the reference."""
    calls = _gluon_taken(monkeypatch)
    err = backend_forward_err(seqs, seed=4)
    assert calls == [any(p for p, n in seqs if n > 1)]
    assert err < TOL


def test_gluon_off_switch(monkeypatch):
    """KVSERVE_GLUON_PREFILL=0 (or a failed warm-up build) keeps the Triton kernel."""
    from kvserve.attention.kernels import mixed
    monkeypatch.setitem(mixed._GLUON_OFF, "reason", "test")
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    assert mixed.gluon_prefill(q, torch.zeros(2, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")) is None
