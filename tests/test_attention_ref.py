"""The torch reference backend against brute-force float64 attention computed
from contiguous K/V (no paging, no SDPA), over mixed prefill/decode batches."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvserve.attention.backend import AttentionLayerInfo, get_backend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec

H, KVH, D = 4, 2, 8
SPECS = [FullAttentionSpec(), SlidingWindowSpec(window=5),
         SlidingWindowSpec(window=7, sink=3), SlidingWindowSpec(window=1)]
# (computed tokens already in the cache, new tokens this step)
MIXED = [(0, 13), (20, 7), (30, 1), (1, 1), (69, 1), (3, 4)]
DECODES = [(0, 1), (9, 1), (40, 1), (70, 1)]


def _reference(q, keys, values, start, spec) -> torch.Tensor:
    """q: [n, H, D] at positions start..start+n-1; keys/values: [L, KVH, D]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = H // KVH
    for i in range(q.shape[0]):
        p = start + i
        visible = [k for k in range(p + 1)
                   if k >= spec.visible_start(p) or k < spec.sink]
        for h in range(H):
            kh = keys[visible, h // group].double()
            scores = kh @ q[i, h].double() / math.sqrt(D)
            probs = torch.softmax(scores, dim=0)
            out[i, h] = probs @ values[visible, h // group].double()
    return out


def _needed(spec, computed: int, total: int, block: int, block_size: int) -> bool:
    """Whether any query of this step reads a key inside `block`."""
    lo, hi = block * block_size, (block + 1) * block_size
    return lo < spec.sink or hi > spec.visible_start(computed)


def _build_batch(seqs, spec, block_size, gen):
    num_blocks = 1 + sum(-(-(c + n) // block_size) for c, n in seqs)
    kv_cache = torch.full((2, num_blocks, block_size, KVH, D), float("nan"))
    kv_cache[:, 0, 0] = 0  # the runner's contract: slot 0 of the null block stays zero
    free_ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(-(-(c + n) // block_size) for c, n in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    full_kv, qs, ks, vs, slots = [], [], [], [], []
    for i, (computed, new) in enumerate(seqs):
        total = computed + new
        keys, values = torch.randn(2, total, KVH, D, generator=gen)
        for b in range(-(-total // block_size)):
            if _needed(spec, computed, total, b, block_size):
                tables[i, b] = free_ids.pop()
        for pos in range(total):
            slot = int(tables[i, pos // block_size]) * block_size + pos % block_size
            if pos < computed and tables[i, pos // block_size] != 0:
                kv_cache[0].view(-1, KVH, D)[slot] = keys[pos]
                kv_cache[1].view(-1, KVH, D)[slot] = values[pos]
            elif pos >= computed:
                slots.append(slot)
        full_kv.append((keys, values))
        qs.append(torch.randn(new, H, D, generator=gen))
        ks.append(keys[computed:])
        vs.append(values[computed:])
    meta = _metadata(seqs, block_size, tables, torch.tensor(slots))
    return meta, kv_cache, torch.cat(qs), torch.cat(ks), torch.cat(vs), full_kv


def _metadata(seqs, block_size, tables, slots) -> AttentionMetadata:
    query_lens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        num_seqs=len(seqs), num_tokens=starts[-1], block_size=block_size,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=[tables], slot_mappings=[slots.long()],
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)


def _to(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    return dataclasses.replace(
        meta, query_start_loc=meta.query_start_loc.to(device), seq_lens=meta.seq_lens.to(device),
        block_tables=[t.to(device) for t in meta.block_tables],
        slot_mappings=[s.to(device) for s in meta.slot_mappings])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decode"])
@pytest.mark.parametrize("block_size", [1, 8, 16, 64])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_matches_bruteforce(seqs, block_size, spec, device):
    gen = torch.Generator().manual_seed(block_size)
    meta, kv_cache, q, k, v, full_kv = _build_batch(seqs, spec, block_size, gen)
    layer = AttentionLayerInfo(layer_idx=0, group_id=0, spec=spec, num_heads=H,
                               num_kv_heads=KVH, head_dim=D, scale=D ** -0.5)
    out = get_backend("torch").forward(q.to(device), k.to(device), v.to(device),
                                       kv_cache.to(device), layer, _to(meta, device)).cpu()
    assert out.shape == (meta.num_tokens, H, D)
    start = 0
    for (computed, new), (keys, values) in zip(seqs, full_kv):
        expected = _reference(q[start:start + new], keys, values, computed, spec)
        torch.testing.assert_close(out[start:start + new].double(), expected,
                                   atol=1e-5, rtol=1e-5)
        start += new


def test_writes_new_kv_at_slots():
    gen = torch.Generator().manual_seed(0)
    spec = FullAttentionSpec()
    meta, kv_cache, q, k, v, _ = _build_batch(MIXED, spec, 8, gen)
    layer = AttentionLayerInfo(0, 0, spec, H, KVH, D, D ** -0.5)
    get_backend("torch").forward(q, k, v, kv_cache, layer, meta)
    slots = meta.slot_mappings[0]
    torch.testing.assert_close(kv_cache[0].view(-1, KVH, D)[slots], k)
    torch.testing.assert_close(kv_cache[1].view(-1, KVH, D)[slots], v)


def test_bfloat16_runs_close():
    gen = torch.Generator().manual_seed(1)
    spec = SlidingWindowSpec(window=7, sink=3)
    meta, kv_cache, q, k, v, _ = _build_batch(MIXED, spec, 16, gen)
    layer = AttentionLayerInfo(0, 0, spec, H, KVH, D, D ** -0.5)
    backend = get_backend("torch")
    ref = backend.forward(q, k, v, kv_cache.clone(), layer, meta)
    out = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                          kv_cache.bfloat16(), layer, meta)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
