"""KV cache behaviour the walks do not pin down exactly, each figure worked out
by hand (or by brute force from a spec's fields) here:

  - every group's `max_blocks` (DeepSeek V4's compressed and compressor-state
    groups too) and the V4 layout's per-sequence figures equal the peak of
    blocks a request really holds;
  - which blocks a moving window returns to the pool, and that a block another
    request still reads is neither returned nor counted as room;
  - a sliding hit whose early blocks were evicted while its window stayed;
  - the host tier's copies, fences and counters along one eviction-and-reload;
  - the integrity checkers fail on each kind of corruption they exist for;
  - bad input is refused with an error naming the limit and the value.
"""
from __future__ import annotations

import pytest

import kvserve.cache.compressed_managers  # noqa: F401 (registers the V4 managers)
from kvserve.cache.block_fill import BlockFill
from kvserve.cache.block_pool import BlockContent, BlockPool, FreeBlockQueue, KVBlock
from kvserve.cache.eviction import ReuseAwareQueue, make_eviction_policy
from kvserve.cache.groups import KVCacheGroup, make_kv_cache_groups
from kvserve.cache.hashing import extend_block_hashes
from kvserve.cache.host_tier import BlockCopy, HostBlockRef, HostTier
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.managers import make_manager
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.cache.v4_specs import CompressedSpec, CompressorStateSpec, v4_kv_layout
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

FULL = FullAttentionSpec()


def request(name: str, tokens: list[int]) -> Request:
    return Request(name, list(tokens), SamplingParams(max_tokens=1000))


def manager(specs, num_blocks: int, block_size: int = 4, **kwargs) -> KVCacheManager:
    return KVCacheManager(make_kv_cache_groups(specs), num_blocks, block_size, **kwargs)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- DeepSeek V4 groups: a layout worked out by hand -------------------------------------

class TinyV4Config:
    """Four layers: sliding, CSA (rate 4), HCA (rate 16), CSA; head_dim 8,
    indexer head_dim 4, window 8."""

    head_dim, index_head_dim, sliding_window, num_hidden_layers = 8, 4, 8, 4
    layer_types = ["sliding_attention", "compressed_sparse_attention",
                   "heavily_compressed_attention", "compressed_sparse_attention"]

    def compress_rate(self, layer_type: str) -> int:
        return {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}.get(layer_type, 0)


def test_v4_layout_of_a_tiny_config():
    """Pages per layer at 8-token blocks (values): sliding 8x8 = 64; CSA state
    8 x (4*8 + 4*4) = 384; CSA entries 2 x (8+4) = 24; HCA state 8 x 16 = 128;
    HCA entries 1 x 8 = 8. Units tried: 384 (largest page) and 768 (both CSA
    state layers); at 64K tokens 384 stores 12,297 blocks x 384 values and 768
    12,295 x 768, so the unit is 384: the sliding layers share a page
    (6 fit), each CSA state layer has its own, the entries share one."""
    layout = v4_kv_layout(TinyV4Config(), 8)
    assert layout.unit == 384 and layout.block_size == 8
    assert [(g.kind.name, g.group.layer_ids) for g in layout.groups] == [
        ("sliding", (0, 1, 2, 3)), ("csa_state", (1,)), ("csa_state", (3,)),
        ("csa_entries", (1, 3)), ("hca_state", (2,)), ("hca_entries", (2,))]
    assert [g.kind.layer_page for g in layout.groups] == [64, 384, 384, 24, 128, 8]
    assert [g.group.spec for g in layout.groups] == [
        SlidingWindowSpec(8), CompressorStateSpec(4, True), CompressorStateSpec(4, True),
        CompressedSpec(4, True), CompressorStateSpec(16, False), CompressedSpec(16, False)]
    assert layout.kv_groups() == [g.group for g in layout.groups]
    assert layout.find("csa_state", 3) == (2, layout.groups[2])
    assert layout.find("sliding", 2)[1].slot(2) == 2 and layout.groups[3].slot(3) == 1
    with pytest.raises(KeyError):
        layout.find("hca_state", 1)
    assert [layout.compressed_kind(i) for i in range(4)] == [None, "csa", "hca", "csa"]
    # 20 tokens = 3 slots: windows hold 2 blocks (HCA state's 16-token window 3),
    # CSA entries fill every slot, HCA entries (one per 16 tokens) slot 1 only.
    assert layout.blocks_per_sequence(20) == {"sliding": 2, "csa_state": 4, "csa_entries": 3,
                                              "hca_state": 3, "hca_entries": 1}
    assert layout.bytes_per_token(20, 2) == pytest.approx(13 * 384 * 2 / 20)
    assert layout.long_run_bytes_per_token(2) == {"csa_entries": 384 * 2 / 8, "hca_entries": 384 * 2 / 16}


class TwentyCsaLayers(TinyV4Config):
    num_hidden_layers = 20
    layer_types = ["compressed_sparse_attention"] * 20


def test_v4_unit_packs_all_entry_pages_when_that_stores_less():
    """20 CSA layers: entry pages of 24 values, 16 to a 384-value unit (the
    largest page, a CSA state's) or all 20 in a 480-value one. At 64K tokens
    in 8-token blocks, 384 stores 2 entry groups of 8,192 blocks (+ 4 sliding
    groups of 2 + 20 state groups of 2): 16,432 x 384 values; 480 stores one
    entry group (+ 3 sliding, 20 state): 8,238 x 480, less. Units holding all
    sliding (1,280) or all state layers (7,680) store more still."""
    layout = v4_kv_layout(TwentyCsaLayers(), 8)
    assert layout.unit == 480
    assert [len(g.group.layer_ids) for g in layout.groups if g.kind.name == "csa_entries"] == [20]
    assert [len(g.group.layer_ids) for g in layout.groups if g.kind.name == "sliding"] == [7, 7, 6]
    assert layout.bytes_per_token(65536, 1) == pytest.approx((3 * 2 + 20 * 2 + 8192) * 480 / 65536)


def test_v4_block_size_must_be_a_multiple_of_the_csa_rate():
    with pytest.raises(ValueError, match="multiple of the CSA rate 4, got 6"):
        v4_kv_layout(TinyV4Config(), 6)
    sliding_only = TinyV4Config()
    sliding_only.layer_types = ["sliding_attention"] * 4
    layout = v4_kv_layout(sliding_only, 6)  # no compressed layer: any block size
    assert {g.kind.name for g in layout.groups} == {"sliding"}
    assert sorted(layer for g in layout.groups for layer in g.group.layer_ids) == [0, 1, 2, 3]


@pytest.mark.parametrize("cls", [CompressorStateSpec, CompressedSpec])
def test_v4_specs_refuse_a_zero_rate(cls):
    with pytest.raises(ValueError, match="compress rate must be >= 1, got 0"):
        cls(0, True)


def test_v4_rate_one_is_valid():
    assert CompressorStateSpec(1, False).window == 1 and CompressedSpec(1, False).entries_per_block(4) == 4


def test_v4_spec_fields():
    assert (CompressorStateSpec(4, True).window, CompressorStateSpec(4, False).window) == (8, 4)
    assert CompressorStateSpec(4, True).visible_start(20) == 13 and CompressorStateSpec(4, True).visible_start(3) == 0
    assert CompressedSpec(4, True).visible_start(99) == 0
    assert CompressorStateSpec(4, True).sink == CompressedSpec(4, True).sink == 0
    assert [CompressedSpec(16, False).holds_entry(i, 8) for i in range(4)] == [False, True, False, True]
    # rate 3 in blocks of 2: entries at positions 2, 5, 8 land in slots 1, 2, 4.
    assert [CompressedSpec(3, False).holds_entry(i, 2) for i in range(5)] == [False, True, True, False, True]
    assert (CompressedSpec(4, True).entries_per_block(8), CompressedSpec(16, True).entries_per_block(8)) == (2, 1)
    assert CompressedSpec(4, True).describe() == "compressed(1/4, +index keys)"
    assert CompressedSpec(128, False).describe() == "compressed(1/128)"
    assert CompressorStateSpec(4, True).describe() == "compressor_state(rate=4, window=8)"


def reference_peak(spec, block_size: int, num_tokens: int, chunk: int) -> int:
    """Blocks a request must hold at its fullest, from the spec's fields: a
    compressed group one per table slot where some entry (every `rate`-th
    position) lands; a window group the blocks of every key a step's queries
    (from p, up to `chunk` of them) read or write, at the worst p."""
    if isinstance(spec, CompressedSpec):
        slots = cdiv(num_tokens, block_size)
        return len({q // block_size for q in range(slots * block_size) if (q + 1) % spec.rate == 0})
    window = getattr(spec, "window", None)
    peak = 0
    for p in range(num_tokens):
        end = min(p + chunk, num_tokens)
        keys = {k for q in range(p, end) for k in range(q + 1) if window is None or q - k < window}
        peak = max(peak, len({k // block_size for k in keys | set(range(p, end))}))
    return peak


@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
def test_v4_max_blocks_and_layout_figures_are_the_true_peak(chunk):
    """Per group, `max_blocks` equals the reference peak and the peak of a
    real allocation walk (decode to every start, then one chunk); the layout's
    `blocks_per_sequence` (what the engine sizes its default pool by) sums
    the same peaks per page kind."""
    layout = v4_kv_layout(TinyV4Config(), 8)
    kv = KVCacheManager(layout.kv_groups(), 400, 8, enable_prefix_caching=False)
    for num_tokens in (5, 17, 24, 33):
        want = [reference_peak(g.spec, 8, num_tokens, chunk) for g in kv.groups]
        assert [m.max_blocks(num_tokens, chunk) for m in kv.managers] == want, num_tokens
        per_kind: dict[str, int] = {}
        for g, peak in zip(layout.groups, want):
            per_kind[g.kind.name] = per_kind.get(g.kind.name, 0) + peak
        assert layout.blocks_per_sequence(num_tokens, chunk) == per_kind, num_tokens
    num_tokens, walked = 33, [0] * len(kv.managers)
    for start in range(num_tokens):
        r = request(f"r{start}", list(range(num_tokens)))
        for num_new in [1] * start + [min(chunk, num_tokens - start)]:
            assert kv.allocate_slots(r, num_new)
            r.num_computed_tokens += num_new
            for g, ids in enumerate(kv.get_block_ids(r.request_id)):
                walked[g] = max(walked[g], sum(1 for b in ids if b))
        kv.free(r)
    assert walked == [m.max_blocks(num_tokens, chunk) for m in kv.managers]
    kv.check_integrity()


def test_full_and_sliding_max_blocks_with_a_sink():
    """Window 5 + sink 3 in blocks of 2, chunk 3: keys [p - 4, p + 3) span
    7 tokens, at most 4 blocks, plus the sink's 2 blocks: 6 (and never more
    than the 5 blocks 10 tokens fill)."""
    full = make_manager(FULL, BlockPool(4), 2, 0)
    sliding = make_manager(SlidingWindowSpec(5, sink=3), BlockPool(4), 2, 0)
    assert (full.max_blocks(9), full.max_blocks(10, 3), full.max_blocks(11, 64)) == (5, 5, 6)
    assert sliding.max_blocks(100, 3) == 6 == reference_sink_peak(5, 3, 2, 100, 3)
    assert sliding.max_blocks(10, 3) == 5 == reference_sink_peak(5, 3, 2, 10, 3)
    kv = manager([FULL, SlidingWindowSpec(5, sink=3)], 8, block_size=2)
    assert kv.num_blocks_needed(100, 3) == 50 + 6 and kv.num_blocks_needed(9) == 5 + 5


def reference_sink_peak(window: int, sink: int, bs: int, num_tokens: int, chunk: int) -> int:
    peak = 0
    for p in range(num_tokens):
        end = min(p + chunk, num_tokens)
        keys = {k for q in range(p, end) for k in range(q + 1) if q - k < window or k < sink}
        peak = max(peak, len({k // bs for k in keys | set(range(p, end))}))
    return peak


def test_v4_compressed_group_hit_keeps_null_slots():
    """A 24-token prompt cached; a request sharing 16 tokens hits all 16 in
    every group. The sliding window (8) and CSA state keep slot 1 only, HCA
    state (16) both slots, CSA entries both, HCA entries slot 1 (its entry at
    position 15); slot 0 of HCA entries holds none."""
    layout = v4_kv_layout(TinyV4Config(), 8)
    kv = KVCacheManager(layout.kv_groups(), 64, 8)
    first = request("a", list(range(24)))
    assert kv.allocate_slots(first, 24)
    kv.free(first)
    computed, hit = kv.get_computed_blocks(request("b", list(range(16)) + [90, 91]))
    assert hit == 16
    real = [[b != 0 for b in ids] for ids in computed.block_ids()]
    assert real == [[False, True], [False, True], [False, True], [True, True], [True, True], [False, True]]


# -- sliding windows: what goes back to the pool ----------------------------------------

@pytest.mark.parametrize("spec, free_after", [
    # window 4: a query at q reads keys q-3..q; block i goes once q >= 4i + 7.
    (SlidingWindowSpec(4), [1, 2, 1, 1, 1, 2, 1]),
    # sink 2 keeps block 0 for good: only block 1 goes (at q = 11).
    (SlidingWindowSpec(4, sink=2), [1, 1, 0, 0, 0, 1, 0]),
])
def test_window_returns_blocks_as_it_moves(spec, free_after):
    """3 usable blocks of 4 tokens; a 6-token prompt, then one query at a
    time from position 6 to 12: free blocks after each step."""
    kv = manager([spec], 4, enable_prefix_caching=False)
    r = request("a", list(range(6)))
    assert kv.allocate_slots(r, 6) and kv.num_free_blocks == 1
    r.num_computed_tokens = 6
    seen = []
    for _ in range(7):
        r.output_token_ids.append(1)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        seen.append(kv.num_free_blocks)
        kv.check_integrity()
    assert seen == free_after


def test_window_drop_frees_only_blocks_no_one_else_reads():
    """Window 4, 4 usable blocks. A holds 3 blocks for 11 tokens; B hits A's
    first 8 tokens, which under the window is A's block 1 only, and takes the
    last free block. A then computes 6 tokens from 11: its blocks 0 and 1
    leave its window, but block 1 is still B's, so only block 0 is room, and
    the 2 new blocks A needs do not fit (nothing changes). Once B finishes,
    block 1 is A's alone and the same step fits."""
    kv = manager([SlidingWindowSpec(4)], 5, eviction_policy="lru")
    a = request("a", list(range(11)))
    assert kv.allocate_slots(a, 11)
    a.num_computed_tokens = 11
    b = request("b", list(range(8)) + [100])
    computed, hit = kv.get_computed_blocks(b)
    a_ids = kv.get_block_ids("a")[0]
    assert hit == 8 and computed.block_ids() == [[0, a_ids[1]]]
    assert kv.allocate_slots(b, 1, computed) and kv.num_free_blocks == 0
    a.output_token_ids.extend([5] * 6)
    assert not kv.allocate_slots(a, 6)
    assert kv.get_block_ids("a")[0] == a_ids and kv.num_free_blocks == 0
    kv.check_integrity()
    kv.free(b)
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(a, 6)
    assert kv.get_block_ids("a")[0][:2] == [0, 0] and kv.num_free_blocks == 1
    kv.check_integrity()


def test_sliding_hit_after_its_first_block_was_evicted():
    """Window 4, 2 usable blocks. A 12-token prompt computed 8 then 4: the
    second step drops block 0 (the window starts at key 5) and reclaims it for
    block 2, evicting block 0's tokens. A request sharing all 12 tokens still
    hits 12: a query at 12 reads keys 9..12, so blocks 0 and 1 are not
    read at all: only block 2 must be cached. It is not cut back to 8."""
    kv = manager([SlidingWindowSpec(4)], 3, eviction_policy="lru")
    a = request("a", list(range(12)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 4)
    assert kv.num_evictions == 1
    kv.free(a)
    computed, hit = kv.get_computed_blocks(request("b", list(range(12)) + [50]))
    assert hit == 12 and [b != 0 for b in computed.block_ids()[0]] == [False, False, True]


def test_hybrid_hit_takes_the_longest_length_valid_in_every_group():
    """Full + window 4, 7 usable blocks, LRU. A 12-token prompt holds blocks
    1-3 (full) and 4-6 (sliding), freed group by group, tail first. A 4-token
    request reclaims the unused block 7 and block 3 (the full group's tail).
    The sliding group alone would hit 12 tokens, the full group 8: the hit is
    8, where the window (keys 5..8) needs sliding block 1 only."""
    kv = manager([FULL, SlidingWindowSpec(4)], 8, eviction_policy="lru")
    a = request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) and kv.get_block_ids("a") == [[1, 2, 3], [4, 5, 6]]
    kv.free(a)
    assert kv.allocate_slots(request("x", list(range(100, 104))), 4)
    assert kv.get_block_ids("x") == [[7], [3]] and kv.num_evictions == 1
    computed, hit = kv.get_computed_blocks(request("b", list(range(12)) + [7]))
    assert hit == 8 and computed.block_ids() == [[1, 2], [0, 5]]


# -- the host tier along one eviction and reload ----------------------------------------

def test_host_tier_copies_fences_and_counters():
    """3 usable GPU blocks, 8 host slots, LRU. A's 2 cached blocks are written
    back when A finishes (slots 0, 1, tail first). B's 3 blocks reclaim the
    unused block and A's two: both already on the host (dedups), so B's batch
    is fenced on A's write-backs (batch 0). C repeats A's 8 tokens: a host hit
    of 2 blocks, loaded into GPU blocks 1 and 2 (B's, evicted after being
    written back in batch 1: the loads' batch is fenced on batch 1)."""
    host = HostTier(8, block_bytes=100)
    kv = manager([FULL], 4, host_tier=host, eviction_policy="lru")
    a = request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) and kv.get_block_ids("a") == [[1, 2]]
    kv.free(a)
    batch = kv.take_pending_copies()
    assert (batch.copies, batch.fence, batch.index) == (
        [BlockCopy(True, 2, 0, background=True), BlockCopy(True, 1, 1, background=True)], -1, 0)
    b = request("b", list(range(100, 112)))
    assert kv.allocate_slots(b, 12) and kv.get_block_ids("b") == [[3, 2, 1]]
    assert (host.num_save_dedups, host.num_saves, kv.num_evictions) == (2, 0, 2)
    kv.free(b)
    batch = kv.take_pending_copies()
    assert (batch.copies, batch.fence, batch.index) == (
        [BlockCopy(True, 1, 2, background=True), BlockCopy(True, 2, 3, background=True),
         BlockCopy(True, 3, 4, background=True)], 0, 1)
    c = request("c", list(range(8)) + [9])
    computed, hit = kv.get_computed_blocks(c)
    assert hit == 8 and computed.num_host_blocks == 2 and computed.block_ids() == [[-1, -1]]
    assert [blk.slot for blk in computed.blocks[0]] == [1, 0]
    assert kv.allocate_slots(c, 1, computed)
    kv.record_prefix_lookup(c, hit, computed)
    batch = kv.take_pending_copies()
    assert (batch.copies, batch.fence, batch.index) == ([BlockCopy(False, 1, 1), BlockCopy(False, 2, 0)], 1, 2)
    assert kv.get_block_ids("c") == [[1, 2, 3]]
    assert (host.num_loads, host.num_save_dedups, host.num_write_backs, host.num_evictions) == (2, 5, 5, 0)
    assert kv.host_metrics() == {
        "kv_host_hit_tokens": 8, "kv_host_swap_outs": 0, "kv_host_swap_ins": 0, "kv_host_swap_drops": 0,
        "kv_host_write_backs": 5, "kv_host_usage_perc": 5 / 8, "kv_host_cached_blocks": 5,
        "kv_host_evictions": 0, "num_requests_swapped": 0}
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits, kv.num_evictions) == (9, 8, 5)
    kv.check_integrity()


def test_full_host_tier_evicts_its_oldest_entry_and_fences_on_it():
    """2 host slots: A's two write-backs (tail first) fill slots 0 and 1. B
    reclaims the unused block and A's tail, whose save finds it on the host
    and refreshes it, so B's write-back evicts A's head (slot 1), the least
    recently used entry; the batch is fenced on A's write-backs (batch 0)."""
    host = HostTier(2, block_bytes=100)
    kv = manager([FULL], 4, host_tier=host, eviction_policy="lru")
    a = request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    kv.free(a)
    kv.take_pending_copies()
    b = request("b", list(range(100, 104)) + [1])
    assert kv.allocate_slots(b, 5)  # the unused block and a's tail (block 2, on the host)
    kv.free(b)
    batch = kv.take_pending_copies()
    assert (batch.copies, batch.fence, batch.index) == ([BlockCopy(True, 3, 1, background=True)], 0, 1)
    assert (host.num_evictions, host.num_save_dedups, host.num_cached, host.usage) == (1, 1, 2, 1.0)
    # A's head left the host but is still cached on the GPU; its tail is on the host.
    computed, hit = kv.get_computed_blocks(request("c", list(range(8)) + [1]))
    assert hit == 8 and computed.block_ids() == [[1, -1]] and computed.blocks[0][1].slot == 0
    kv.check_integrity()
    # D reclaims A's head (block 1) from the GPU: not on the host any more, so
    # it is saved (an urgent copy), into the slot of the host's LRU entry, A's
    # tail, which is now gone from both tiers: A's prompt hits its head only.
    d = request("d", list(range(200, 204)) + [1])
    assert kv.allocate_slots(d, 5) and kv.get_block_ids("d") == [[1, 2]]
    batch = kv.take_pending_copies()
    assert (batch.copies, batch.fence, batch.index) == ([BlockCopy(True, 1, 0)], 0, 2)
    assert (host.num_saves, host.num_evictions, kv.num_evictions) == (1, 2, 2)
    computed, hit = kv.get_computed_blocks(request("c", list(range(8)) + [1]))
    assert hit == 4 and computed.block_ids() == [[-1]] and computed.blocks[0][0].slot == 0
    kv.check_integrity()


def _swapped_out(num_tokens: int):
    """Request "a" with `num_tokens` computed tokens, swapped out of an 8-block
    pool into a 4-slot host tier: (host, kv, request, its GPU block ids)."""
    host = HostTier(4, block_bytes=10)
    kv = manager([FULL], 8, host_tier=host, enable_prefix_caching=False)
    r = request("a", list(range(num_tokens)))
    assert kv.allocate_slots(r, num_tokens)
    r.num_computed_tokens = num_tokens
    ids = kv.get_block_ids("a")[0]
    kv.swap_out(r)
    return host, kv, r, ids


def test_swap_round_trip_counts():
    host, kv, r, ids = _swapped_out(10)
    assert kv.num_free_blocks == 7 and host.num_swap_out_blocks == 3
    assert [c.gpu_block for c in kv.take_pending_copies().copies] == ids
    assert kv.host_metrics()["num_requests_swapped"] == 1 and kv.host_metrics()["kv_host_swap_outs"] == 1
    with pytest.raises(ValueError, match="cannot be swapped out"):
        kv.swap_out(request("z", [1]))
    r.num_computed_tokens = 0
    computed, hit = kv.get_computed_blocks(r)
    assert hit == 10 and computed.is_swap_in and computed.num_host_blocks == 3
    assert kv.allocate_slots(r, 0, computed)
    assert kv.num_swap_ins == 1 and host.usage == 0.0 and kv.num_free_blocks == 4
    kv.check_integrity()
    kv.free(r)
    with pytest.raises(ValueError, match="request 'a' was swapped in already"):
        kv.allocate_slots(r, 1, computed)


# -- integrity checkers fail on what they guard -------------------------------------------

# -- the decode fast path (moves within the tail block) ------------------------------------

def test_a_decode_step_that_fills_the_tail_block_is_cached_if_the_request_finishes_there():
    """Prompt of 6 (block size 4), two decode steps: the second fills block 2.
    The request may finish right there: freeing it caches both blocks, and a
    request with the same 8 tokens hits them (while it ran, only block 1)."""
    kv = manager([FULL], 8)
    a = request("a", [1, 2, 3, 4, 5, 6])
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    for token in (7, 8):
        a.output_token_ids.append(token)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    kv.check_integrity()
    assert kv.fragmentation() == 0.0
    assert kv.get_computed_blocks(request("x", [1, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 4
    kv.free(a)
    kv.check_integrity()
    _, num_hit = kv.get_computed_blocks(request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert num_hit == 8


def test_the_decode_fast_path_refuses_an_end_outside_the_tail_block():
    """End 10 (tail block 2 holds 2): an allocation back to 5 (block 1) or on
    to 13 (a new block) is no move within the tail, and takes the slow path."""
    kv = manager([FULL], 8)
    a = request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 3)  # end 13: block 3 is new
    assert len(kv.get_block_ids("a")[0]) == 4
    kv.check_integrity()
    b = request("b", list(range(100, 110)))
    assert kv.allocate_slots(b, 10)  # nothing computed yet: a retry of a smaller chunk moves the end back
    assert kv.allocate_slots(b, 5)  # end 5, inside block 1 (fills 4, 1, 0): the fill counters follow
    kv.check_integrity()
    assert kv.fragmentation() == pytest.approx(1 - (13 + 5) / (4 * 4 + 3 * 4))


def test_no_fast_path_on_a_cached_tail_that_another_request_joins():
    """A step caches A's full block 2, then computes fewer tokens than it
    scheduled: A's end moves back into that block, which stays in the hash map.
    B's prefix hit then holds it too, so A's next decode must not treat it as
    its own (an in-place fill update would move B's count instead)."""
    kv = manager([FULL], 12)
    a = request("a", list(range(12)))
    assert kv.allocate_slots(a, 12)  # blocks 0-2 full and cached
    assert kv.allocate_slots(a, 10)  # the step computed nothing: the end moves back to 10
    a.num_computed_tokens = 10
    assert kv._tail_is_cached("a", 2) and "a" not in kv._room
    b = request("b", list(range(12)) + [99])
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12 and kv.allocate_slots(b, 1, computed)
    assert kv.allocate_slots(a, 1)  # end 11 inside the shared block
    kv.check_integrity()
    assert kv.fragmentation() == pytest.approx(1 - (4 + 4 + 4 + 1) / (4 * 4))


def _busy_manager(**kwargs) -> tuple[KVCacheManager, Request]:
    kv = manager([FULL], 8, **kwargs)
    r = request("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    kv.check_integrity()
    return kv, r


@pytest.mark.parametrize("corrupt, message", [
    (lambda kv: setattr(kv.pool.blocks[1], "ref_cnt", 2), "ref_cnt 2 but 1 block tables"),
    (lambda kv: kv.pool.free_queue.remove(kv.pool.blocks[7]), "has ref_cnt 0 but is not in the free queue"),
    (lambda kv: kv.pool.free_queue.append(kv.pool.null_block), "the NULL block is in the free queue"),
    (lambda kv: kv.pool.free_queue.append(kv.pool.blocks[1]), "has ref_cnt > 0 but is in the free queue"),
    (lambda kv: setattr(kv.pool.null_block, "ref_cnt", 1), "NULL block was referenced or cached"),
    (lambda kv: kv.managers[0].req_to_blocks["a"].append(kv.pool.blocks[1]), "holds a block twice in group 0"),
    (lambda kv: kv.pool.cached.update({(0, b"x" * 16): kv.pool.blocks[1]}), "whose hash/group differ"),
    (lambda kv: setattr(kv.pool.blocks[1], "num_children", 5), "counts 5 cached children, the hash map says 1"),
    (lambda kv: kv.pool._num_children.clear(), "cached child counts disagree"),
    (lambda kv: kv._held.block_ids("a")[0].__setitem__(0, 7), "block-id mirror of 'a' in group 0"),
    (lambda kv: setattr(kv._held.fill, "used_slots", 11), "fragmentation counters disagree"),
    # blocks 1, 2, 3 hold 4, 4, 2 tokens: swapping two fills keeps both totals
    (lambda kv: kv._held.fill._fills.update({1: {2: 1}, 3: {4: 1}}), "fragmentation counters disagree"),
    (lambda kv: setattr(kv._held.fill, "num_held", 4), "fragmentation counters disagree"),
    # the decode fast path's room ([9, 12]: the tail block 3) moved past the tail, or its counters stale
    (lambda kv: kv._room.update({"a": (13, 16, *kv._room["a"][2:])}), r"room \[13, 16\] is not its tail block"),
    (lambda kv: kv._room.update({"a": (9, 12, [{1: 1}], kv._room["a"][3])}), "fast-path tail counters are stale"),
    (lambda kv: setattr(kv.managers[0].blocks("a")[2], "block_hash", b"x"), "fast-path room on a cached tail"),
    # a table (of NULL only, so the pool agrees) with no mirror
    (lambda kv: kv.managers[0].req_to_blocks.update({"ghost": [kv.pool.null_block]}),
     r"block-id mirror of 'ghost' in group 0 is \[\]"),
])
def test_integrity_check_catches(corrupt, message):
    kv, _ = _busy_manager(eviction_policy="lru")
    corrupt(kv)
    with pytest.raises(RuntimeError, match=message):
        kv.check_integrity()


def test_free_queue_length_mismatch_is_caught():
    kv, _ = _busy_manager(eviction_policy="lru")
    kv.pool.free_queue._len += 1
    with pytest.raises(RuntimeError, match="free queue holds 4 blocks, num_free_blocks says 5"):
        kv.check_integrity()


@pytest.mark.parametrize("corrupt", ["hit count", "list"])
def test_reuse_queue_block_in_the_wrong_list_is_caught(corrupt):
    """A's 10 tokens freed: block 3 (partial) uncached, block 2 a cold leaf,
    block 1 inner. A hit count changed without `update`, or a block whose
    list pointer is lost, is a block in the wrong list."""
    kv, r = _busy_manager(eviction_policy="reuse")
    kv.free(r)
    kv.check_integrity()
    if corrupt == "hit count":
        kv.pool.blocks[2].num_hits = 1
    else:
        kv.pool.blocks[3].free_list = None
    with pytest.raises(RuntimeError, match=r"KVBlock\(id=[23], .*\) sits in the wrong eviction list"):
        kv.check_integrity()


def test_reuse_queue_total_mismatch_is_caught():
    """The reuse queue keeps its four lists' total (read on every allocation);
    a total that drifts from them is caught."""
    kv, r = _busy_manager(eviction_policy="reuse")
    kv.free(r)
    kv.pool.free_queue._cold._len += 1
    with pytest.raises(RuntimeError, match="the eviction lists hold 8 blocks, their total says 7"):
        kv.check_integrity()


def test_host_integrity_check_catches():
    host, kv, r, _ = _swapped_out(8)
    kv.check_integrity()
    host._private.add(3)
    with pytest.raises(RuntimeError, match="host slot 3 is both free and private"):
        kv.check_integrity()
    host._private.discard(3)
    host._free_slots.remove(3)
    with pytest.raises(RuntimeError, match="host tier tracks 3 of 4 slots"):
        kv.check_integrity()
    host._free_slots.append(3)
    kv._swapped["a"].tables[0].pop()
    with pytest.raises(RuntimeError, match="private host slots disagree"):
        kv.check_integrity()
    no_host = manager([FULL], 8)
    no_host._swapped["x"] = kv._swapped["a"]
    with pytest.raises(RuntimeError, match="swapped requests without a host tier"):
        no_host.check_integrity()


def test_host_integrity_catches_a_swapped_request_holding_gpu_blocks_and_pins():
    host, kv, r, _ = _swapped_out(8)
    assert kv.allocate_slots(request("a", [1, 2, 3]), 3)  # same id back on the GPU
    with pytest.raises(RuntimeError, match="swapped request 'a' also holds GPU blocks"):
        kv.check_integrity()
    host2 = HostTier(4, block_bytes=10)
    kv2 = manager([FULL], 4, host_tier=host2, eviction_policy="lru")
    a = request("a", list(range(4)) + [9])
    assert kv2.allocate_slots(a, 5)
    kv2.free(a)  # block 1 cached and written back
    ((key, entry),) = host2.entries().items()
    ref = HostBlockRef(entry.slot, key, entry.content)
    host2.pin([ref])
    with pytest.raises(RuntimeError, match="left pinned"):
        kv2.check_integrity()
    host2.unpin([ref])
    kv2.check_integrity()
    host2._entries[key].content = BlockContent(None, (9, 9, 9, 9), 0)
    with pytest.raises(RuntimeError, match="different contents"):
        kv2.check_integrity()


def test_block_fill_refuses_to_remove_an_unknown_holder():
    fill = BlockFill(4)
    fill.add(5, 3)
    with pytest.raises(RuntimeError, match="block 5 has no holder with fill 2 to remove"):
        fill.remove(5, 2)
    with pytest.raises(RuntimeError, match="block 6 has no holder with fill 1"):
        fill.remove(6, 1)


def test_block_fill_counts_a_shared_block_at_its_fullest_holder():
    fill = BlockFill(4)
    fill.add(5, 1)
    fill.add(5, 3)
    fill.add(5, 3)
    assert (fill.num_held, fill.used_slots) == (1, 3)
    fill.remove(5, 3)
    assert fill.used_slots == 3
    fill.remove(5, 3)
    assert fill.used_slots == 1 and fill.fragmentation() == pytest.approx(0.75)
    fill.move(5, 1, 4)
    assert fill.used_slots == 4 and fill.largest_fills() == {5: 4}
    fill.remove(5, 4)
    assert (fill.num_held, fill.used_slots, fill.fragmentation()) == (0, 0, 0.0)


# -- bad input names the limit and the value ----------------------------------------------

def test_reset_forgets_hashes_without_evicting():
    """After a reset the blocks are plain free blocks: reusing every one of
    them drops no hash (no eviction) and nothing of the old prompt hits."""
    for policy in ("lru", "reuse"):
        kv = manager([FULL], 4, eviction_policy=policy)
        a = request("a", list(range(12)))
        assert kv.allocate_slots(a, 12)
        kv.free(a)
        assert kv.reset_prefix_cache()
        b = request("b", list(range(12)))
        computed, hit = kv.get_computed_blocks(b)
        assert hit == 0 and kv.allocate_slots(b, 12, computed)
        assert kv.num_evictions == 0 and kv.num_free_blocks == 0
        kv.check_integrity()


def test_block_repr_says_whether_it_is_cached():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    assert repr(block) == "KVBlock(id=1, ref=1, uncached)"
    pool.cache_block(block, 0, b"h" * 16, BlockContent(None, (1,), 0))
    assert repr(block) == "KVBlock(id=1, ref=1, cached)"


def test_host_metrics_without_a_host_tier_are_zero():
    kv = manager([FULL], 8)
    assert kv.host_metrics() == {
        "kv_host_hit_tokens": 0, "kv_host_swap_outs": 0, "kv_host_swap_ins": 0, "kv_host_swap_drops": 0,
        "kv_host_write_backs": 0, "kv_host_usage_perc": 0.0, "kv_host_cached_blocks": 0,
        "kv_host_evictions": 0, "num_requests_swapped": 0}
    assert kv.take_pending_copies().copies == [] and not kv.take_pending_copies()


def test_pool_and_queue_errors():
    with pytest.raises(ValueError, match=r"need at least 2 KV blocks \(one is reserved\), got 1"):
        BlockPool(1)
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="asked for 3 blocks, only 2 free"):
        pool.get_new_blocks(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match=r"double free of KVBlock\(id=1, ref=0, uncached\)"):
        pool.free_blocks([block])
    with pytest.raises(ValueError, match="no free blocks left"):
        FreeBlockQueue().popleft()
    with pytest.raises(ValueError, match=r"KVBlock\(id=1, ref=0, uncached\) is not in the free queue"):
        FreeBlockQueue().remove(KVBlock(1))


def test_a_block_taken_from_the_queue_is_not_in_it_any_more():
    first, second = KVBlock(1), KVBlock(2)
    queue = FreeBlockQueue([first, second])
    assert queue.popleft() is first
    with pytest.raises(ValueError, match=r"KVBlock\(id=1, ref=0, uncached\) is not in the free queue"):
        queue.remove(first)
    queue.remove(second)
    with pytest.raises(ValueError, match=r"KVBlock\(id=2, ref=0, uncached\) is not in the free queue"):
        queue.remove(second)
    assert len(queue) == 0


class ListQueue(list):
    """The simplest eviction policy (a list): it can hold a block twice."""

    def popleft(self):
        return self.pop(0)

    def update(self, block):
        pass


def test_a_block_twice_in_the_free_queue_is_caught():
    pool = BlockPool(4, ListQueue())
    pool.check_integrity({})
    pool.free_queue.append(pool.blocks[2])
    with pytest.raises(RuntimeError, match=r"KVBlock\(id=2, ref=0, uncached\) is in the free queue twice"):
        pool.check_integrity({})


def test_reuse_queue_errors_and_hot_fraction_range():
    for ok in (0.0, 1.0):
        assert ReuseAwareQueue(ok).hot_fraction == ok
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"hot_fraction must be in \[0, 1\], got {bad}"):
            ReuseAwareQueue(bad)
    with pytest.raises(ValueError, match="no free blocks left"):
        ReuseAwareQueue().popleft()
    with pytest.raises(ValueError, match=r"KVBlock\(id=2, ref=0, uncached\) is not in the free queue"):
        ReuseAwareQueue().remove(KVBlock(2))
    assert isinstance(make_eviction_policy("lru"), FreeBlockQueue)
    assert isinstance(make_eviction_policy("reuse"), ReuseAwareQueue)
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, reuse, got 'fifo'"):
        make_eviction_policy("fifo")


def test_manager_errors():
    with pytest.raises(ValueError, match="needs at least one KV cache group"):
        KVCacheManager([], 8, 4)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        KVCacheManager(make_kv_cache_groups([FULL]), 8, 0)
    kv = manager([FULL], 8)
    r = request("a", list(range(9)))
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0, got -1"):
        kv.allocate_slots(r, -1)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        extend_block_hashes(r, 0)
    with pytest.raises(ValueError, match="no KV cache manager for attention spec 'lin'"):
        make_manager("lin", BlockPool(3), 4, 0)
    with pytest.raises(ValueError, match="the model has no attention layers to build KV cache groups for"):
        make_kv_cache_groups([])
    with pytest.raises(ValueError, match="the host KV tier needs at least 1 block, got 0"):
        HostTier(0, 10)
    with pytest.raises(ValueError, match="swap-out of 5 blocks does not fit the host tier"):
        HostTier(4, 10).swap_out([1, 2, 3, 4, 5])


def test_a_hit_is_only_for_admission_and_only_while_fresh():
    kv = manager([FULL], 8, eviction_policy="lru")
    a = request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    kv.free(a)
    b = request("b", list(range(8)) + [1])
    computed, hit = kv.get_computed_blocks(b)
    assert hit == 8
    assert kv.can_allocate(b, 1, computed) and kv.num_free_blocks == 7  # changes nothing
    filler = request("f", list(range(100, 128)))
    assert kv.allocate_slots(filler, 28)  # 7 blocks: a's two are evicted last
    assert kv.num_evictions == 2
    kv.free(filler)
    with pytest.raises(ValueError, match="stale prefix hit"):
        kv.allocate_slots(b, 1, computed)
    computed, hit = kv.get_computed_blocks(b)
    assert hit == 0
    assert kv.allocate_slots(b, 9, computed)
    computed, _ = kv.get_computed_blocks(request("b", list(range(100, 105))))
    with pytest.raises(ValueError, match="already holds blocks; pass a prefix hit only when admitting"):
        kv.allocate_slots(b, 1, computed)


def _sliding_hit_after_an_eviction(num_evicted: int):
    """Window 4, 4 usable blocks, LRU. U's block (1) is cached and freed, then
    A's 12 tokens take blocks 2-4, freed tail first: the queue is 1, 4, 3, 2.
    B repeats A's tokens: its hit is [NULL, NULL, block 4] (a query at 12
    reads keys 9..12). Then `num_evicted` blocks are reclaimed: 1 evicts U's
    block only, 2 evicts block 4 too."""
    kv = manager([SlidingWindowSpec(4)], 5, eviction_policy="lru")
    u = request("u", list(range(500, 504)))
    assert kv.allocate_slots(u, 4) and kv.get_block_ids("u") == [[1]]
    kv.free(u)
    a = request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) and kv.get_block_ids("a") == [[2, 3, 4]]
    kv.free(a)
    b = request("b", list(range(12)) + [50])
    computed, hit = kv.get_computed_blocks(b)
    assert hit == 12 and computed.block_ids() == [[0, 0, 4]]
    assert kv.allocate_slots(request("x", list(range(900, 900 + 4 * num_evicted))), 4 * num_evicted)
    assert kv.num_evictions == num_evicted
    return kv, b, computed


def test_a_hit_with_null_slots_survives_an_unrelated_eviction():
    kv, b, computed = _sliding_hit_after_an_eviction(1)
    assert kv.allocate_slots(b, 1, computed)
    assert kv.get_block_ids("b") == [[0, 0, 4, 3]]  # the hit, then the LRU's next block
    kv.check_integrity()


def test_a_hit_block_evicted_behind_null_slots_is_stale():
    kv, b, computed = _sliding_hit_after_an_eviction(2)
    with pytest.raises(ValueError, match="stale prefix hit"):
        kv.allocate_slots(b, 1, computed)
    kv.check_integrity()


@pytest.mark.parametrize("spec", [FULL, SlidingWindowSpec(4), SlidingWindowSpec(6, sink=2)],
                         ids=lambda s: s.describe())
def test_can_allocate_answers_what_allocate_slots_does(spec):
    """Every prompt length with every number of free blocks, then chunks of
    1, 3 and 4 tokens: can_allocate is True exactly when allocate_slots
    succeeds (and it changes nothing: allocate_slots runs right after)."""
    for free in range(6):
        for prompt in range(1, 17):
            kv = manager([spec], 6, enable_prefix_caching=False)  # 5 usable
            if free < 5:
                filler = request("f", list(range(4 * (5 - free))))
                assert kv.allocate_slots(filler, 4 * (5 - free))
            r = request("r", list(range(100, 140)))
            for num_new in (prompt, 1, 3, 4, 1):
                expected = kv.can_allocate(r, num_new)
                assert kv.allocate_slots(r, num_new) == expected, (free, prompt, num_new)
                if not expected:
                    break
                r.num_computed_tokens += num_new


# -- small figures ---------------------------------------------------------------------------

def test_hashes_cover_known_full_blocks_only_and_extend_in_place():
    r = request("a", list(range(10)))
    extend_block_hashes(r, 4)
    first = list(r.block_hashes)
    assert len(first) == 2
    r.output_token_ids.extend([1, 2])
    r.num_pending_tokens = 3  # unknown ids are never hashed
    extend_block_hashes(r, 4)
    assert r.block_hashes[:2] == first and len(r.block_hashes) == 3
    whole = request("b", list(range(10)) + [1, 2])
    extend_block_hashes(whole, 4)
    assert whole.block_hashes == r.block_hashes
    salted = request("c", list(range(10)) + [1, 2])
    salted.cache_salt = "s"   # the chain's root: every hash after it differs
    extend_block_hashes(salted, 4)
    assert len(salted.block_hashes) == 3
    assert all(x != y for x, y in zip(salted.block_hashes, whole.block_hashes))


def test_introspection_figures():
    kv = manager([FULL, SlidingWindowSpec(4)], 11)
    assert kv.num_usable_blocks == 10 and kv.usage == 0.0
    assert kv.get_block_ids("nobody") == [[], []]
    r = request("a", list(range(9)))
    assert kv.allocate_slots(r, 9)
    ids = kv.get_block_ids("a")
    ids[0].append(99)  # a copy: the mirror is untouched
    assert kv.get_block_ids("a")[0] == ids[0][:3]
    assert kv.usage == pytest.approx(6 / 10)
    assert kv.first_block_hash(r) == r.block_hashes[0]
    assert kv.first_block_hash(request("s", [1, 2, 3])) is None
    off = manager([FULL], 11, enable_prefix_caching=False)
    assert off.first_block_hash(r) is None
    assert not kv.reset_prefix_cache()
    kv.free(r)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(request("b", list(range(9))))[1] == 0


def test_group_layer_maps():
    """Full layers 0, 2, 4 and sliding 1, 3 in groups of 2: F(0, 2), F(4), S(1, 3)."""
    sw = SlidingWindowSpec(8)
    kv = manager([FULL, sw, FULL, sw, FULL], 8)
    assert [g.layer_ids for g in kv.groups] == [(0, 2), (4,), (1, 3)]
    assert kv.layer_to_group == [0, 2, 0, 2, 1] and kv.layer_to_slot == [0, 0, 1, 1, 0]
    assert kv.group_size == 2
    assert KVCacheGroup(FULL, [3, 1]).layer_ids == (3, 1)


def test_each_evicted_block_saved_counts_once():
    """`HostTier.save` of three distinct evicted blocks: three copies queued into three slots,
    `num_saves` 3 (the count the metrics export); the same block again is a dedup, not a save."""
    host = HostTier(4, block_bytes=100)
    blocks = []
    for i in range(3):
        block = KVBlock(10 + i)
        block.cache_group, block.block_hash = 0, bytes([i])
        block.content = BlockContent(None, (i,), i)
        blocks.append(block)
        host.save(block)
    assert [(c.gpu_block, c.host_slot) for c in host.pending] == [(10, 0), (11, 1), (12, 2)]
    host.save(blocks[1])
    assert (host.num_saves, host.num_save_dedups, host.num_cached) == (3, 1, 3)


def test_a_reserve_stays_free_when_a_running_request_opens_its_next_block():
    """`allocate_slots(..., reserve=n)` on a running request at a block boundary: the direct
    path that opens the next block must leave n blocks free as the general path does, so it
    fails with exactly the pool's free blocks and succeeds with one more."""
    for spare, expected in ((0, False), (1, True)):
        kv = manager([FULL], 4 + spare)   # null block + a's 2 blocks, then 1 + spare free
        a = request("a", list(range(8)))
        assert kv.allocate_slots(a, 8)
        a.num_computed_tokens = 8
        free = kv.num_free_blocks
        assert kv.allocate_slots(a, 1, reserve=1) is expected, spare
        assert kv.num_free_blocks == (free - 1 if expected else free)
        kv.check_integrity()
