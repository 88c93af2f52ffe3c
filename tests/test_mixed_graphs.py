"""Mixed-step CUDA graphs: the tile table, the fixed-grid varlen kernel, and
whole-engine replay against eager execution.

The tile table is checked against a brute-force listing. The fixed-grid
kernel runs on a batch padded as a graph pads it (extra tokens with slot -1,
empty sequences, idle tile programs) and is compared per sequence with the
float32 torch reference; padded output rows must stay poisoned. On the CPU it
runs under TRITON_INTERPRET=1 in a subprocess; on the GPU directly.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from tests.triton_interpreter import run_interpreted

MIXED = [(0, 37), (300, 77), (41, 1), (0, 1), (130, 20), (7, 33)]


def _brute_force_tiles(query_lens, block_q):
    pairs = [(i, t) for i, q in enumerate(query_lens) for t in range(-(-q // block_q))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


@pytest.mark.parametrize("block_q", [1, 4, 32])
def test_tile_table_lists_every_query_tile_once(block_q):
    pytest.importorskip("triton")
    from kvserve.attention.kernels.prefill import tile_table
    rng = random.Random(block_q)
    for _ in range(20):
        lens = [rng.choice([0, 1, rng.randint(1, 100)]) for _ in range(rng.randint(1, 12))]
        seq, q_tile = tile_table(torch.tensor(lens, dtype=torch.int32), block_q)
        assert (seq.tolist(), q_tile.tolist()) == _brute_force_tiles(lens, block_q)


def test_tile_table_can_skip_one_query_sequences():
    pytest.importorskip("triton")
    from kvserve.attention.kernels.prefill import tile_table
    lens = [1, 37, 0, 1, 5, 1]
    seq, q_tile = tile_table(torch.tensor(lens, dtype=torch.int32), 4, skip_single=True)
    kept = [n if n != 1 else 0 for n in lens]
    assert (seq.tolist(), q_tile.tolist()) == _brute_force_tiles(kept, 4)


def test_prefill_split_plan():
    """Small steps split their keys; large ones, short contexts and a fixed
    count are respected; the partials stay within their budget."""
    pytest.importorskip("triton")
    from kvserve.attention.kernels.prefill import PARTIALS_BUDGET, PrefillConfig
    config = PrefillConfig()  # 32 query tokens a tile at 32 heads / 8 KV heads
    plan = lambda tokens, keys: config.plan_splits(tokens, 32, 8, 128, keys, 132)  # noqa: E731
    assert plan(16, 4096) == 16          # 8 programs unsplit: as many splits as allowed
    assert plan(16, 1024) == 4           # but no split under min_split_keys
    assert plan(16, 100) == 1
    assert plan(8192, 8192) == 1         # 2,048 programs fill the GPU unsplit
    for tokens in (16, 64, 256, 512, 2048):
        n = plan(tokens, 8192)
        assert n == 1 or tokens * 32 * 128 * 4 * n <= PARTIALS_BUDGET, (tokens, n)
    assert PrefillConfig(num_splits=5).plan_splits(8192, 32, 8, 128, 8192, 132) == 5


def test_token_buckets_and_capacities():
    pytest.importorskip("triton")
    from kvserve.runner.mixed_graph import token_buckets
    assert token_buckets(8192)[-1] == 2048
    assert token_buckets(100) == [16, 32, 64, 96, 100]
    assert token_buckets(8) == []
    assert all(a < b for a, b in zip(token_buckets(8192), token_buckets(8192)[1:]))


def test_bucket_holds_the_step_query_tiles():
    """A step with more chunks than a bucket's tile table holds takes a larger
    bucket, or none (eager)."""
    pytest.importorskip("triton")
    from types import SimpleNamespace
    from kvserve.runner.mixed_graph import CHUNK_TILES, MixedGraphs
    graphs = MixedGraphs(SimpleNamespace(local_attention_heads=(32, 8)), 1, 16, 4096, 256, 8192,
                         torch.device("cpu"))
    assert graphs.block_q == 32 and graphs.tile_capacity(64) == 2 + CHUNK_TILES
    assert graphs.bucket_for(64, 49, 1) == 64
    assert graphs.bucket_for(64, 49, 2 + CHUNK_TILES + 1) == 96
    assert graphs.bucket_for(2000, 40, 200) is None
    assert graphs.bucket_for(3000, 40, 1) is None


def _padded(meta, q, pad_tokens: int, pad_seqs: int, tiles, capacity: int):
    """The batch as a graph bucket holds it: more tokens, empty sequences, idle tiles."""
    from kvserve.attention.metadata import PrefillTiles
    n, device = meta.num_tokens, q.device
    q = torch.cat([q, torch.randn(pad_tokens, *q.shape[1:]).to(device, q.dtype)])
    qsl = torch.cat([meta.query_start_loc, torch.full((pad_seqs,), n, dtype=torch.int32, device=device)])
    seq_lens = torch.cat([meta.seq_lens, torch.ones(pad_seqs, dtype=torch.int32, device=device)])
    table = meta.block_tables[0]
    table = torch.cat([table, torch.zeros(pad_seqs, table.shape[1], dtype=table.dtype, device=device)])
    seq = torch.full((capacity,), -1, dtype=torch.int32)
    q_tile = torch.zeros(capacity, dtype=torch.int32)
    seq[:len(tiles[0])], q_tile[:len(tiles[0])] = tiles
    return q, qsl, seq_lens, table, PrefillTiles(seq.to(device), q_tile.to(device))


def tiled_check(device: str, dtype, heads=8, kv_heads=2, head_dim=32) -> None:
    """Fixed-grid kernel = float32 reference per sequence; padding rows
    untouched; unsplit and with the keys split over three programs."""
    from kvserve.attention.kernels.prefill import PrefillConfig
    for config in (PrefillConfig(block_m=16), PrefillConfig(block_m=16, num_splits=3)):
        _tiled_check(device, dtype, heads, kv_heads, head_dim, config)


def _tiled_check(device, dtype, heads, kv_heads, head_dim, config) -> None:
    from tests.test_triton_kernels import _build_batch, _layer, _reference
    from kvserve.attention.kernels import reshape_and_cache
    from kvserve.attention.kernels.mixed import mixed_attention
    from kvserve.attention.kernels.prefill import prefill_attention, tile_table
    from kvserve.attention.triton_backend import mask_bounds
    for spec, block_size in ((FullAttentionSpec(), 8), (SlidingWindowSpec(window=20, sink=3), 16)):
        gen = torch.Generator().manual_seed(block_size)
        meta, kv_cache, q, k, v = _build_batch(MIXED, spec, block_size, heads, kv_heads, head_dim,
                                               device, gen, dtype)
        layer = _layer(spec, heads, kv_heads, head_dim)
        ref = _reference(q, k, v, kv_cache.clone(), layer, meta)
        reshape_and_cache(k, v, kv_cache, meta.slot_mappings[0])
        block_q = config.block_q(heads, kv_heads)
        tiles = tile_table(torch.tensor(meta.query_lens_cpu, dtype=torch.int32), block_q)
        qp, qsl, seq_lens, table, ptiles = _padded(meta, q, 9, 3, tiles, len(tiles[0]) + 5)
        # The mixed split's table as a graph writes it: no tiles for one-query rows.
        split_tiles = tile_table(torch.tensor(meta.query_lens_cpu, dtype=torch.int32), block_q, skip_single=True)
        *_, mixed_tiles = _padded(meta, q, 9, 3, split_tiles, len(tiles[0]) + 5)
        window, sink = mask_bounds(layer)
        # As a graph replays them: the varlen kernel alone, and the mixed split (its decode
        # kernel planned for a context bound far above the batch's, as a captured graph is).
        for run in (lambda out: prefill_attention(qp, kv_cache, out, table, qsl, seq_lens, 10**6, layer.scale,
                                                  window, sink, config=config, tiles=ptiles),
                    lambda out: mixed_attention(qp, kv_cache, out, table, qsl, seq_lens, 10**6, 4096,
                                                layer.scale, window, sink, tiles=mixed_tiles,
                                                prefill_config=config)):
            out = torch.full_like(qp, float("nan"))
            run(out)
            assert torch.isnan(out[meta.num_tokens:]).all(), "a padding row was written"
            starts = meta.query_start_loc.tolist()
            for i, (a, b) in enumerate(zip(starts, starts[1:])):
                err = float((out[a:b].float() - ref[a:b]).norm() / ref[a:b].norm())
                assert err < 1e-2, (spec, i, err)


def test_fixed_grid_kernel_under_interpreter():
    run_interpreted("import torch, tests.test_triton_kernels as t, tests.test_mixed_graphs as m; "
                    "t._patch_interpreter_scalar_index(); m.tiled_check('cpu', torch.float16)", timeout=300)


@pytest.mark.gpu
def test_fixed_grid_kernel_on_gpu():
    tiled_check("cuda", torch.bfloat16, heads=32, kv_heads=8, head_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3-hybrid", "llama"])
def test_mixed_graph_replay_equals_eager(tmp_path, kind):
    """Prompts chunked at 48 tokens beside running decodes: nearly every step
    is mixed. Graphs must replay (counted) and give eager's tokens in fp32."""
    from kvserve import LLM, SamplingParams
    from tests.tiny_models import random_prompts, save_tiny_checkpoint
    path = save_tiny_checkpoint(kind, tmp_path / kind, max_position_embeddings=1024)
    rng = random.Random(1)
    prompts = random_prompts([rng.randint(1, 300) for _ in range(rng.randint(20, 40))])
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True)
              for _ in prompts]
    outs = {}
    for eager in (True, False):
        llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=1024, enforce_eager=eager,
                  max_num_seqs=16, max_num_batched_tokens=48, kv_cache_memory_gb=1)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[eager] = [o.outputs[0].token_ids for o in got]
        runner = llm.engine.runner
    mixed = runner.mixed_graphs
    assert mixed is not None and sum(mixed.num_replays.values()) > 10, mixed.num_replays
    assert outs[False] == outs[True]
