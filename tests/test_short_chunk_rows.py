"""Short prompt chunks of a mixed graph step as one-query rows (`runner/mixed_graph.py`):
the split's arrays, attention over them equal to the batch's own (the torch reference,
against brute-force float64), and the engine's greedy tokens on the GPU."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvserve.attention.backend import AttentionLayerInfo, get_backend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.runner import mixed_graph
from kvserve.runner.mixed_graph import split_short_chunks
from tests.test_attention_ref import D, H, KVH, _build_batch, _reference

# (computed tokens in the cache, new tokens): decodes beside chunks of 2, 5, 8 and 13 tokens.
SEQS = [(0, 13), (20, 5), (30, 1), (1, 2), (69, 1), (3, 8), (17, 1)]


def test_split_cuts_only_chunks_up_to_the_bound():
    split = split_short_chunks([13, 5, 1, 2, 1, 8, 1], [13, 25, 31, 3, 70, 11, 18], 5)
    assert split.rows.tolist() == [0, 1, 1, 1, 1, 1, 2, 3, 3, 4, 5, 6]
    assert split.query_lens.tolist() == [13, 1, 1, 1, 1, 1, 1, 1, 1, 1, 8, 1]
    assert split.seq_lens.tolist() == [13, 21, 22, 23, 24, 25, 31, 2, 3, 70, 11, 18]
    assert split.query_start.tolist() == [0, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 30, 31]
    assert split_short_chunks([13, 1, 1], [13, 5, 9], 8) is None   # no chunk of 2..8 tokens
    assert split_short_chunks([2, 1], [9, 5], 1) is None


def _split_meta(meta: AttentionMetadata, max_rows: int) -> AttentionMetadata:
    split = split_short_chunks(meta.query_lens_cpu, meta.seq_lens_cpu, max_rows)
    rows = torch.from_numpy(split.rows)
    return AttentionMetadata(
        num_seqs=len(split.rows), num_tokens=meta.num_tokens, block_size=meta.block_size,
        query_start_loc=torch.from_numpy(split.query_start), seq_lens=torch.from_numpy(split.seq_lens),
        block_tables=[t.index_select(0, rows) for t in meta.block_tables], slot_mappings=meta.slot_mappings,
        max_query_len=int(split.query_lens.max()), max_seq_len=meta.max_seq_len,
        query_lens_cpu=split.query_lens.tolist(), seq_lens_cpu=split.seq_lens.tolist())


@pytest.mark.parametrize("spec", [FullAttentionSpec(), SlidingWindowSpec(window=5),
                                  SlidingWindowSpec(window=7, sink=3)], ids=lambda s: s.describe())
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("max_rows", [2, 8, 32])
def test_split_rows_attend_as_their_chunks(spec, block_size, max_rows):
    """The cache holds the step's K/V before attention (the backend writes it first), so each
    split row reads its chunk's earlier tokens from the cache: the output equals the batch's
    own and brute-force float64 attention, token by token."""
    gen = torch.Generator().manual_seed(block_size * 100 + max_rows)
    meta, kv_cache, q, k, v, full_kv = _build_batch(SEQS, spec, block_size, gen)
    layer = AttentionLayerInfo(layer_idx=0, group_id=0, spec=spec, num_heads=H, num_kv_heads=KVH,
                               head_dim=D, scale=D ** -0.5)
    backend = get_backend("torch")
    whole = backend.forward(q, k, v, kv_cache.clone(), layer, meta)
    split = backend.forward(q, k, v, kv_cache.clone(), layer, _split_meta(meta, max_rows))
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)
    start = 0
    for (computed, new), (keys, values) in zip(SEQS, full_kv):
        expected = _reference(q[start:start + new], keys, values, computed, spec)
        torch.testing.assert_close(split[start:start + new].double(), expected, atol=1e-5, rtol=1e-5)
        start += new


@pytest.mark.gpu
def test_mixed_graphs_with_split_chunks_give_eagers_tokens(tmp_path, monkeypatch):
    """Prompts chunked at 48 tokens beside running decodes, chunks of up to 32 tokens replayed
    as one-query rows: the split replays (counted) and gives eager's greedy tokens in fp32."""
    from kvserve import LLM, SamplingParams
    from tests.tiny_models import random_prompts, save_tiny_checkpoint
    monkeypatch.setattr(mixed_graph, "SHORT_CHUNK_ROWS", 32)
    path = save_tiny_checkpoint("llama", tmp_path / "llama", max_position_embeddings=1024)
    rng = random.Random(2)
    prompts = random_prompts([rng.randint(2, 300) for _ in range(rng.randint(20, 40))])
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True) for _ in prompts]
    outs = {}
    for eager in (True, False):
        llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=1024, enforce_eager=eager,
                  max_num_seqs=16, max_num_batched_tokens=48, kv_cache_memory_gb=1)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[eager] = [o.outputs[0].token_ids for o in got]
        runner = llm.engine.runner
    assert runner.mixed_graphs.num_split_replays > 3, runner.mixed_graphs.num_split_replays
    assert outs[False] == outs[True]
    assert np.mean([len(o) for o in outs[False]]) > 1
