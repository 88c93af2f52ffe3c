"""Which kernel the TMA path runs (kvserve/attention/kernels/mixed.py), on the CPU: the Gluon
kernel where it serves the launch, only with chunks shorter than a page sent elsewhere when
there are cached prefixes; the Triton kernel otherwise; the gates and the short-chunk bound
follow the kernel. The kernels themselves are stand-ins that record their calls (the GPU tests,
tests/test_prefill_gluon.py, run the real ones)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("triton")
from kvserve.attention.kernels import mixed  # noqa: E402

PAGE = 16


class _Tensor(SimpleNamespace):
    """What the dispatch reads of q and the cache: is_cuda and shape."""


def _q():
    return _Tensor(is_cuda=True, shape=(4096, 32, 128))


def _cache():
    return _Tensor(is_cuda=True, shape=(2, 100, PAGE, 8, 128))


@pytest.fixture
def kernels(monkeypatch):
    """Record every launch: ("gluon" | "triton", cached_prefixes, min length)."""
    calls = []
    fake = SimpleNamespace(supports_gluon=lambda q, kv: True,
                           prefill_attention_gluon=lambda *a, **kw: calls.append(
                               ("gluon", kw["cached_prefixes"], kw["min_q_len"]) + (kw["tiles"],) * bool(kw["tiles"])))
    monkeypatch.setattr(mixed, "_gluon_module", lambda: fake)
    monkeypatch.setitem(mixed._GLUON_OFF, "reason", None)
    monkeypatch.setattr(mixed, "prefill_attention_tma", lambda *a, **kw: calls.append(
        ("triton", kw["cached_prefixes"], kw["from_length"])))
    return calls


def _launch(cached_prefixes: bool, split: int, paged_below: int, tile_list=None) -> None:
    mixed._tma_prefill(_q(), (None, None), _cache(), None, None, None, None, 4096, 1.0, cached_prefixes, split,
                       paged_below, tile_list)


def test_fresh_steps_take_gluon(kernels):
    _launch(False, 0, 0)
    assert kernels == [("gluon", False, 2)]   # one-query rows stay the decode kernel's


def test_prefixes_take_gluon_only_with_short_chunks_sent_elsewhere(kernels):
    _launch(True, PAGE, PAGE)
    _launch(True, 0, 0)            # nothing promises chunks under a page go elsewhere
    _launch(True, 2048, 2048)
    assert kernels == [("gluon", True, PAGE), ("triton", True, 0), ("gluon", True, 2048)]


def test_gluon_runs_the_work_list_for_its_rows(kernels):
    """The backend's list, asked for the rows the Gluon kernel takes (min_q_len), is its grid."""
    asked = []
    _launch(True, PAGE, PAGE, lambda n: asked.append(n) or f"items of rows >= {n}")
    _launch(False, 0, 0, lambda n: asked.append(n) or f"items of rows >= {n}")
    assert asked == [PAGE, 2]
    assert kernels == [("gluon", True, PAGE, f"items of rows >= {PAGE}"), ("gluon", False, 2, "items of rows >= 2")]


def test_off_switch_keeps_triton(kernels, monkeypatch):
    monkeypatch.setitem(mixed._GLUON_OFF, "reason", "KVSERVE_GLUON_PREFILL=0")
    _launch(False, 0, 0)
    assert kernels == [("triton", False, 0)]
    assert mixed.tma_gates(_q(), _cache()) == (mixed.TMA_MIN_LONGEST_CHUNK, mixed.TMA_MIN_FRESH_SHARE)
    assert mixed.short_chunk_bound(_q(), _cache(), True) == mixed.TMA_SHORT_CHUNKS_PAGED_BELOW


def test_disable_gluon_switches_it_off(kernels, caplog):
    mixed.disable_gluon("build failed")
    assert mixed.gluon_prefill(_q(), _cache()) is None and "build failed" in caplog.text
    _launch(False, 0, 0)
    assert kernels == [("triton", False, 0)]


def test_gates_and_bound_follow_the_kernel(kernels):
    assert mixed.tma_gates(_q(), _cache()) == (mixed.GLUON_MIN_LONGEST_CHUNK, mixed.GLUON_MIN_FRESH_SHARE)
    assert mixed.short_chunk_bound(_q(), _cache(), True) == max(mixed.TMA_SHORT_CHUNKS_PAGED_BELOW, PAGE)
    assert mixed.short_chunk_bound(_q(), _cache(), False) == mixed.TMA_SHORT_CHUNKS_PAGED_BELOW


def test_cpu_tensors_never_load_the_gluon_module(monkeypatch):
    monkeypatch.setattr(mixed, "_gluon_module", lambda: pytest.fail("Gluon module loaded for a CPU launch"))
    cpu_q = _Tensor(is_cuda=False, shape=(4096, 32, 128))
    assert mixed.tma_gates(cpu_q, _cache()) == (mixed.TMA_MIN_LONGEST_CHUNK, mixed.TMA_MIN_FRESH_SHARE)
    assert mixed.short_chunk_bound(cpu_q, _cache(), True) == mixed.TMA_SHORT_CHUNKS_PAGED_BELOW


def test_a_failed_warm_up_build_switches_gluon_off(monkeypatch):
    """The warm-up builds the Gluon kernel; one that raises leaves the Triton kernel serving."""
    from kvserve.attention.kernels import warmup
    monkeypatch.setitem(mixed._GLUON_OFF, "reason", None)

    def broken(*a, **kw):
        raise RuntimeError("PassManager::run failed")
    monkeypatch.setattr(warmup, "gluon_prefill", lambda q, kv: broken)
    assert warmup._warm_gluon(_q(), None, _cache(), None, None, None, None, 1.0) == 0
    assert mixed._GLUON_OFF["reason"] == "RuntimeError: PassManager::run failed"
    calls = []
    monkeypatch.setattr(warmup, "gluon_prefill", lambda q, kv: lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(warmup, "_one_row_list", lambda q, kv: "tiles")
    assert warmup._warm_gluon(_q(), None, _cache(), None, None, None, None, 1.0) == 4
    # both builds over the full grid, then both over a work list (`LISTED`)
    assert [(kw["cached_prefixes"], kw.get("tiles")) for kw in calls] == \
        [(True, None), (False, None), (True, "tiles"), (False, "tiles")]


def test_a_failed_listed_warm_up_leaves_gluon_on(monkeypatch):
    """A listed launch that fails to build only leaves that variant to compile at its first step."""
    from kvserve.attention.kernels import warmup
    monkeypatch.setitem(mixed._GLUON_OFF, "reason", None)

    def listed_broken(*a, tiles=None, **kw):
        if tiles is not None:
            raise RuntimeError("PassManager::run failed")
    monkeypatch.setattr(warmup, "gluon_prefill", lambda q, kv: listed_broken)
    monkeypatch.setattr(warmup, "_one_row_list", lambda q, kv: "tiles")
    assert warmup._warm_gluon(_q(), None, _cache(), None, None, None, None, 1.0) == 2
    assert mixed._GLUON_OFF["reason"] is None


def test_the_listed_warm_up_lists_the_tiny_batchs_prompt_row():
    """One item: the prompt row (sequence 1) from its first query; the one-query row is left out."""
    pytest.importorskip("triton.experimental.gluon")
    import torch
    from kvserve.attention.kernels import warmup
    tiles = warmup._one_row_list(torch.zeros(1 + warmup.PREFILL_QUERY, 32, 128), torch.zeros(2, 9, 16, 8, 128))
    assert tiles.dtype == torch.int32 and tiles.tolist() == [[1, 0]]
