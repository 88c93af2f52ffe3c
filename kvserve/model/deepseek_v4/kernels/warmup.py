"""Start-up builds of the V4 kernels a growing context asks for: the indexer's top-k for every
context the engine may reach, the attention's prefill config, the Gluon kernel's key bounds, and
the routed experts' kernels at every step size.

The top-k kernel takes its tile and shortcut sizes from the step's longest row (`TopKBuild`), so a
prompt whose context grows chunk by chunk asks for a new build about once an octave of entries,
and the first step to ask compiles it, seconds each on a cold Triton cache (a 64K-token prompt's
prefill: 36.4 s in an H100 machine's first run, 1.3 s once the builds were cached, 2026-12-06;
`benchmarks/v4_model_bench.py --builds` lists the builds each chunk makes). `warm_top_k` launches
each build that rows of up to `max_model_len // rate` entries can ask for once, on one padding row
(sequence -1: the kernel writes -1s and exits), so they compile before the first request.
Long prefill chunks take the attention's prefill config, whose HCA build no start-up step made
(the memory profile's chunk is short of context, so its HCA layers take the planned config);
`warm_prefill_attention` builds it, and the CSA one, on one padding token. Shorter chunks take the
Gluon kernel while their plan is small, a build per octave of keys a token (`warm_gluon_attention`).
Steps of up to 8 tokens take the small-step config and its split reduction, a build per power of
two of the splits the plan gives (`warm_small_step_attention`): graph capture made only those of
the steps it captures, so an eager engine's first decodes compiled the rest.
The routed experts' route and GEMMs build per tile config and pair block (`warm_moe`).
Every pointer Triton sees starts 16-byte aligned (the indexer scores long chunks in parts of a
multiple of 16 rows): an unaligned one would ask for a build of its own.
`benchmarks/v4_launch_variants.py` counts the builds a growing context asks for.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import triton

from kvserve.cache.v4_specs import V4KVLayout
from kvserve.model.deepseek_v4.kernels.indexer import TOP_K_CONFIG, TopKBuild, score_width, top_k_indices
from kvserve.model.deepseek_v4.kernels.pages import PageRef, V4PagedBatch
from kvserve.model.deepseek_v4.kernels.sparse_attention import (DECODE_CONFIGS, PREFILL_CONFIG, _gluon_module,
                                                               _max_keys, head_block, plan_splits,
                                                               row_align_of, sm_count, sparse_attention)


logger = logging.getLogger(__name__)

WARMUP_THREADS_ENV = "KVSERVE_WARMUP_THREADS"


def warmup_threads() -> int:
    """Threads the start-up builds run on: KVSERVE_WARMUP_THREADS, else up to 8 of the host's cores."""
    value = os.environ.get(WARMUP_THREADS_ENV, str(min(8, os.cpu_count() or 1)))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{WARMUP_THREADS_ENV} must be a whole number >= 1, got {value!r}")
    return int(value)


def _each(fn, items: list, device: torch.device) -> None:
    """fn(item) for every item, on up to `warmup_threads()` threads. Each item's launch compiles a
    build of its own, and Triton's compiler runs them side by side (two top-k builds: 5.2 s one
    after the other, 2.9 s on two threads of this project's 2-core CPU, Triton 3.9)."""
    threads = min(len(items), warmup_threads())
    index = cuda_index(device) if threads > 1 else None

    def run(item):
        with torch.no_grad():   # grad mode is per thread: a worker's starts on
            fn(item)

    done: set[int] = set()

    def work(i):
        if index is not None:
            torch.cuda.set_device(index)   # a new thread's current device is the first GPU
        run(items[i])
        done.add(i)
    if threads <= 1:
        for item in items:
            run(item)
        return
    # The first launch on this thread: a kernel's first launch also sets up what every later one
    # shares (its source hash, its per-device build cache), which is not for threads to race on.
    run(items[0])
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="v4-warmup") as pool:
            list(pool.map(work, range(1, len(items))))   # re-raises the first failure
    except Exception as e:   # a build that fails on a thread alone must not stop the engine: again, in turn
        logger.warning("V4 start-up builds on %d threads failed (%s: %s): building the other %d one at a time",
                       threads, type(e).__name__, e, len(items) - 1 - len(done))
        for i in range(1, len(items)):
            if i not in done:
                run(items[i])


def cuda_index(device: torch.device) -> int | None:
    """`device`'s GPU index, the current one for a bare "cuda" (`set_device` refuses a device without
    an index); None off CUDA."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def top_k_row_bounds(max_entries: int, k: int) -> list[int]:
    """One row length for each distinct `TopKBuild` of rows up to `max_entries`. The sizes move
    only where a length passes a power of two (next power of two, bit length), so the powers of
    two, one past each and `max_entries` itself meet every build."""
    lengths = {n for i in range(max_entries.bit_length()) for n in (1 << i, (1 << i) + 1)} | {max_entries}
    first: dict[TopKBuild, int] = {}
    for n in sorted(x for x in lengths if x <= max_entries):
        first.setdefault(TopKBuild.of(n, k, TOP_K_CONFIG), n)
    return sorted(first.values())


def warm_top_k(device: torch.device, max_model_len: int, rate: int, k: int) -> int:
    """Launch the top-k once per build up to `max_model_len`; returns how many builds."""
    bounds = top_k_row_bounds(max(1, max_model_len // rate), k)
    seq_idx = torch.full((1,), -1, dtype=torch.int32, device=device)
    positions = torch.zeros(1, dtype=torch.int64, device=device)
    out = torch.empty(1, k, dtype=torch.int32, device=device)   # each launch writes the same -1s

    def launch(entries: int) -> None:
        batch = V4PagedBatch(out, V4KVLayout(1, 1, ()), [], seq_idx, positions, entries * rate)
        scores = torch.empty(1, score_width(entries * rate, rate), dtype=torch.float32, device=device)
        top_k_indices(scores, batch, rate, k, out)
    _each(launch, bounds, device)
    return len(bounds)


@dataclass(frozen=True)
class AttentionPages:
    """One attention layer's pages and constants, as its attention launch takes them."""
    sliding: PageRef
    entries: PageRef | None   # a sliding-only layer: None (rate 0)
    rate: int
    topk: int | None   # CSA: the indexer's k; HCA and sliding-only: None


def warm_prefill_attention(batch: V4PagedBatch, layers: list[AttentionPages], heads: int, head_dim: int,
                           window: int) -> int:
    """The prefill config's attention once per layer kind, on `batch`'s one padding token (its
    tables are never read). One split, as a prefill chunk's plan gives: the split count is not
    part of a build, but one token alone would plan many and their partial buffers. Returns the
    launches."""
    device, config = batch.storage.device, replace(PREFILL_CONFIG, num_splits=1)
    q = torch.zeros(1, heads, head_dim, dtype=batch.storage.dtype, device=device)
    sinks = torch.zeros(heads, dtype=torch.float32, device=device)
    for layer in layers:
        indices = None if layer.topk is None else torch.full((1, layer.topk), -1, dtype=torch.int32, device=device)
        sparse_attention(q, layer.sliding, layer.entries, indices, sinks, head_dim ** -0.5, window, layer.rate, batch,
                         torch.empty_like(q), config)
    return len(layers)


def small_step_splits(max_keys: int, heads: int, num_sms: int) -> list[int]:
    """One split count for each build of the split reduction (its `SPLITS_POW2`) that the small-step
    config (`DECODE_CONFIGS[0]`) plans for steps of up to its token bound over up to `max_keys` keys
    a token. The plan reads the keys as tiles only, so a tile count stands for every key count in it."""
    bound, config = DECODE_CONFIGS[0]
    head_groups = triton.cdiv(heads, head_block(config, heads))
    first: dict[int, int] = {}
    for tiles in range(1, triton.cdiv(max_keys, config.block_n) + 1):
        for n in range(1, bound + 1):
            splits = plan_splits(n, tiles * config.block_n, num_sms, config, head_groups)
            if splits > 1:
                first.setdefault(max(2, triton.next_power_of_2(splits)), splits)
    return sorted(first.values())


def warm_small_step_attention(batch: V4PagedBatch, layers: list[AttentionPages], heads: int, head_dim: int,
                              window: int) -> int:
    """The small-step config's builds (`DECODE_CONFIGS[0]`: steps of up to 8 tokens, below the Gluon
    kernel): its attention once per layer kind (sliding-only included), then its split reduction
    once per build those steps plan up to the most keys a token has at `batch.max_seq_len`
    (`small_step_splits`). Graph capture builds only those of the steps it captures: an eager
    engine's first decode, and a short prompt's step, would build the rest. One padding token.
    Returns the launches."""
    if not layers:
        return 0
    device, config = batch.storage.device, DECODE_CONFIGS[0][1]
    q = torch.zeros(1, heads, head_dim, dtype=batch.storage.dtype, device=device)
    sinks = torch.zeros(heads, dtype=torch.float32, device=device)
    keys = {i: _max_keys(batch, window, layer.rate, layer.topk) for i, layer in enumerate(layers)}
    widest = max(keys, key=keys.get)
    launches = [(i, 1) for i in range(len(layers))]
    launches += [(widest, s) for s in small_step_splits(keys[widest], heads, sm_count(device))]

    def launch(item: tuple[int, int]) -> None:
        layer = layers[item[0]]
        indices = None if layer.topk is None else torch.full((1, layer.topk), -1, dtype=torch.int32, device=device)
        sparse_attention(q, layer.sliding, layer.entries, indices, sinks, head_dim ** -0.5, window, layer.rate, batch,
                         torch.empty_like(q), replace(config, num_splits=item[1]))
    _each(launch, launches, device)
    return len(launches)


def gluon_tile_bounds(max_keys: int) -> list[int]:
    """The Gluon kernel's staged-id bounds (MAX_TILES) that steps of up to `max_keys` keys a token
    ask for: each power of two up to the bound's (a build each)."""
    from kvserve.model.deepseek_v4.kernels.sparse_decode_gluon import BLOCK_N, MAX_IDS, max_tiles
    return [1 << i for i in range(max_tiles(min(max_keys, MAX_IDS), BLOCK_N).bit_length())]


def warm_gluon_attention(batch: V4PagedBatch, layers: list[AttentionPages], heads: int, head_dim: int,
                         window: int) -> int:
    """The Gluon kernel's builds an eager step can ask for: each layer kind's plan unit, each
    staged-id bound up to the most keys a token has at `batch.max_seq_len` (a prompt's chunks take
    the kernel while their plan is small, at a new bound each octave of keys), and each count of
    programs a token `dim_parts` gives (a short prompt's step: two; a long chunk's: one). One padding
    token (its plan all -1). Returns the launches (0 where the kernel is off or unsupported)."""
    gluon = _gluon_module()
    if gluon is None or not gluon.enabled_by_env() or not layers:
        return 0
    max_keys = max(_max_keys(batch, window, layer.rate, layer.topk) for layer in layers)
    device = batch.storage.device
    q = torch.zeros(1, heads, head_dim, dtype=batch.storage.dtype, device=device)
    sinks, out = torch.zeros(heads, dtype=torch.float32, device=device), torch.empty_like(q)
    aligns = {row_align_of(batch, layer.sliding, entries) for layer in layers for entries in (layer.entries, None)}
    sms = gluon.sm_count(device)
    parts = {gluon.dim_parts(n, sms) for n in (gluon.GLUON_MIN_TOKENS, gluon.DIM_PARTS_MAX_TOKENS + 1, sms + 1)}
    builds = [(align, tiles * gluon.BLOCK_N, p) for align in sorted(aligns) for tiles in gluon_tile_bounds(max_keys)
              for p in sorted(parts) if gluon.supports(q, batch.storage, out, tiles * gluon.BLOCK_N, align)]

    def launch(build: tuple[int, int, int]) -> None:
        align, keys, p = build
        plan = torch.full((1, keys), -1, dtype=torch.int64, device=device)
        gluon.sparse_decode_gluon(q, batch.storage, plan, align, sinks, 1.0, torch.empty_like(q), parts=p)
    _each(launch, builds, device)
    return len(builds)


def warm_moe(moe, max_tokens: int, device: torch.device) -> int:
    """The routed experts' builds (`moe.route` and the two grouped GEMMs) a step of up to
    `max_tokens` tokens can ask for: one step of each distinct `moe_build`'s token count, run
    through the gate and `fused_moe` on zero inputs (24 steps for 32 experts, 32 for 256, all under
    400 tokens: the pair block stops growing at 4,096 pairs). `moe` is one `layers.MoE`: every
    layer shares the kernels. Returns the launches."""
    from kvserve.model.deepseek_v4.kernels.moe import fused_moe, moe_build
    k, experts, hidden = moe.gate.top_k, moe.w1.shape[0], moe.w1.shape[2]
    first: dict[tuple, int] = {}
    for n in range(1, max_tokens + 1):
        first.setdefault(moe_build(n * k, experts, moe.w1.dtype), n)

    def launch(n: int) -> None:
        x = torch.zeros(n, hidden, dtype=moe.w1.dtype, device=device)
        weights, indices = moe.gate.forward_fused(x, torch.zeros(n, dtype=torch.long, device=device))
        fused_moe(x, moe.w1, moe.w3, moe.w2, weights, indices, moe.limit)
    _each(launch, sorted(first.values()), device)
    return len(first)


def padding_batch(storage: torch.Tensor, layout: V4KVLayout, max_seq_len: int) -> V4PagedBatch:
    """A batch of one padding token (sequence -1) over `storage`, its tables 16 null entries wide."""
    tables = [torch.zeros(1, 16, dtype=torch.int32, device=storage.device) for _ in range(max(1, len(layout.groups)))]
    return V4PagedBatch(storage, layout, tables, torch.full((1,), -1, dtype=torch.int32, device=storage.device),
                        torch.zeros(1, dtype=torch.int64, device=storage.device), max_seq_len)
