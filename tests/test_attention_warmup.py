"""Start-up compiles of the eager attention variants (kvserve/attention/kernels/warmup.py).

On the GPU: after the warm-up, eager decode and mixed attention over batches whose
split plans take every count from 1 to the kernels' maximum compile nothing (counted
with Triton's post-compile hook). On the CPU: the split counts cover every padding
of the reduces, and the warm-up itself runs under the interpreter.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvserve.attention.backend import AttentionLayerInfo
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from tests.triton_interpreter import run_interpreted


def _layers(heads=32, kv_heads=8, head_dim=128):
    specs = [FullAttentionSpec(), SlidingWindowSpec(window=4096)]
    return [AttentionLayerInfo(i, 0, spec, heads, kv_heads, head_dim, head_dim ** -0.5)
            for i, spec in enumerate(specs)]


@pytest.mark.parametrize("max_splits", [16, 64])
def test_split_counts_reach_every_reduce_padding(max_splits):
    pytest.importorskip("triton")
    from kvserve.attention.kernels.warmup import split_counts
    counts = split_counts(max_splits)
    assert counts[0] == 1 and max(counts) <= max_splits
    paddings = {max(2, 1 << (n - 1).bit_length()) for n in counts[1:]}
    assert paddings == {1 << b for b in range(1, max_splits.bit_length())}


def interpreted_warmup():
    """Run under TRITON_INTERPRET=1: one full and one sliding layer, tiny heads."""
    from kvserve.attention.kernels.warmup import warm_eager_attention
    launches = warm_eager_attention(_layers(4, 2, 16), 8, torch.float16, torch.device("cpu"))
    print(launches)


def test_warmup_runs_under_interpreter():
    out = run_interpreted("from tests import test_attention_warmup as t; t.interpreted_warmup()", timeout=300)
    # decode: 7 split counts x 2 kinds a shape; prefill: 5 counts, twice for the full layer (its large tiles)
    assert int(out.split()[-1]) == (7 * 2 + 5 * 2) + (7 * 2 + 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_compile_after_warmup_for_any_eager_split_plan():
    from triton import knobs
    from kvserve.attention.kernels import decode_attention, mixed_attention
    from kvserve.attention.kernels.warmup import warm_eager_attention
    device = torch.device("cuda")
    layers = _layers()
    warm_eager_attention(layers, 16, torch.bfloat16, device)
    compiled = []
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **info: compiled.append(info["fn"].name)
    try:
        rng = random.Random(0)
        for num_seqs in (1, 2, 3, 5, 9, 17, 33, 65, 130, 256):
            for layer in layers:
                _eager_launches(layer, num_seqs, rng, device, decode_attention, mixed_attention)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert compiled == []


def _eager_launches(layer, num_seqs, rng, device, decode_attention, mixed_attention):
    """A decode-only and a mixed launch of `num_seqs` rows at random contexts up to 8K, and
    for full attention a mixed launch past the large-tile threshold, with the step's K/V
    (the TMA path, with and without its prefix loop) and without (the large tiles)."""
    window = getattr(layer.spec, "window", None)
    heads, kv_heads, dim, block = layer.num_heads, layer.num_kv_heads, layer.head_dim, 16
    contexts = [rng.randint(1, 8192) for _ in range(num_seqs)]
    queries = [1] * num_seqs
    queries[0] = min(contexts[0], rng.randint(2, 300))   # one prefill row in the mixed launch
    batches = [[1] * num_seqs, queries]
    if window is None:   # a step past the large-tile threshold (kernels/mixed.py)
        contexts[0] = max(contexts[0], 4200)
        batches.append([4200] + [1] * (num_seqs - 1))
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    width = -(-max(contexts) // block)
    cache = torch.zeros(2, width + 1, block, kv_heads, dim, dtype=torch.bfloat16, device=device)
    table = torch.randint(1, width + 1, (num_seqs, width), dtype=torch.int32, device=device)
    for lens in batches:
        starts = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
        q = torch.randn(int(starts[-1]), heads, dim, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q)
        if lens is batches[-1] and window is None:   # the TMA path: the step's own K/V given
            fresh = torch.zeros(q.shape[0], kv_heads, dim, dtype=torch.bfloat16, device=device)
            for cached_prefixes in (True, False):
                mixed_attention(q, cache, out, table, starts, seq_lens, max(lens), max(contexts), layer.scale,
                                window, 0, fresh_kv=(fresh, fresh), cached_prefixes=cached_prefixes)
        if lens is not batches[0]:
            mixed_attention(q, cache, out, table, starts, seq_lens, max(lens), max(contexts), layer.scale,
                            window, 0)
        else:
            k = torch.zeros(num_seqs, kv_heads, dim, dtype=torch.bfloat16, device=device)
            slots = torch.full((num_seqs,), -1, dtype=torch.int64, device=device)
            decode_attention(q, cache, out, table, starts, seq_lens, max(contexts), layer.scale, window, 0,
                             new_kv=(k, k, slots))


@pytest.mark.parametrize("tokens, head_dim, dtype, window, tiles, given, large", [
    (4096, 128, torch.bfloat16, None, None, None, True),
    (4095, 128, torch.bfloat16, None, None, None, False),      # below the threshold
    (8192, 256, torch.bfloat16, None, None, None, False),      # its shared memory does not fit
    (8192, 128, torch.float32, None, None, None, False),
    (8192, 128, torch.bfloat16, 4096, None, None, False),      # measured with full attention only
    (8192, 128, torch.bfloat16, None, "tiles", None, False),   # a graph's tile table is built for the default
    (8192, 128, torch.bfloat16, None, None, "fixed", False),   # a caller's own config stands
])
def test_large_eager_steps_take_the_large_tile_config(monkeypatch, tokens, head_dim, dtype, window, tiles,
                                                      given, large):
    pytest.importorskip("triton")
    from kvserve.attention.kernels import mixed
    from kvserve.attention.kernels.prefill import PrefillConfig
    seen = {}
    monkeypatch.setattr(mixed, "decode_attention", lambda *a, **k: None)
    monkeypatch.setattr(mixed, "prefill_attention", lambda *a, config, **k: seen.setdefault("config", config))
    q = torch.empty(tokens, 4, head_dim, dtype=dtype)
    kv_cache = torch.empty(2, 1, 16, 1, head_dim, dtype=dtype)
    extra = {} if given is None else {"prefill_config": PrefillConfig(num_splits=2)}
    mixed.mixed_attention(q, kv_cache, q, None, None, None, tokens, tokens, 1.0, window, 0,
                          tiles=tiles, **extra)
    assert (seen["config"] is mixed.LARGE_TILES) == large


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cached_prefixes", [False, True])
def test_no_compile_after_warmup_for_a_listed_gluon_step(cached_prefixes):
    """A large eager step with one-query rows beside a prompt row takes the Gluon prefill kernel
    over a work list (`LISTED`): the warm-up compiles it too (a cold cache once spent 2.5 s
    compiling it inside the qa scenario)."""
    from triton import knobs
    from kvserve.attention.kernels import mixed
    from kvserve.attention.kernels.warmup import warm_eager_attention
    device = torch.device("cuda")
    layer = _layers()[0]
    heads, kv_heads, dim, block = layer.num_heads, layer.num_kv_heads, layer.head_dim, 16
    q_probe = torch.zeros(1, heads, dim, dtype=torch.bfloat16, device=device)
    if mixed.gluon_prefill(q_probe, torch.zeros(2, 2, block, kv_heads, dim, dtype=torch.bfloat16, device=device)) is None:
        pytest.skip("the Gluon prefill kernel does not serve this GPU")
    warm_eager_attention([layer], block, torch.bfloat16, device)
    lens, contexts = [4200] + [1] * 64, [4200 + 256 * cached_prefixes] + [300] * 64
    width = -(-max(contexts) // block)
    cache = torch.zeros(2, len(lens) * width + 1, block, kv_heads, dim, dtype=torch.bfloat16, device=device)
    table = torch.arange(1, len(lens) * width + 1, dtype=torch.int32, device=device).view(len(lens), width)
    starts = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    q = torch.zeros(int(starts[-1]), heads, dim, dtype=torch.bfloat16, device=device)
    fresh = torch.zeros(q.shape[0], kv_heads, dim, dtype=torch.bfloat16, device=device)
    from kvserve.attention.kernels.prefill_gluon import plan_tiles
    lists = []

    def tile_list(min_q_len):
        lists.append(torch.from_numpy(plan_tiles(lens, contexts, heads // kv_heads, min_q_len)).to(device))
        return lists[-1]
    compiled = []
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **info: compiled.append(info["fn"].name)
    try:
        mixed.mixed_attention(q, cache, torch.empty_like(q), table, starts, seq_lens, max(lens), max(contexts),
                              layer.scale, None, 0, fresh_kv=(fresh, fresh), cached_prefixes=cached_prefixes,
                              paged_below=block if cached_prefixes else 0, tile_list=tile_list)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert lists, "the step did not take the Gluon kernel's list"
    assert compiled == []
