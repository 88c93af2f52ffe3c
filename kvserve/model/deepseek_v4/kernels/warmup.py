"""Start-up builds of the V4 indexer's top-k for every context the engine may reach.

The top-k kernel takes its tile and shortcut sizes from the step's longest row (`TopKBuild`), so a
prompt whose context grows chunk by chunk asks for a new build about once an octave of entries,
and the first step to ask compiles it, seconds each on a cold Triton cache (a 64K-token prompt's
prefill: 36.4 s in an H100 machine's first run, 1.3 s once the builds were cached, 2026-12-06;
which builds took the time was not measured). `warm_top_k` launches
each build that rows of up to `max_model_len // rate` entries can ask for once, on one padding
row (sequence -1: the kernel writes -1s and exits), so they compile before the first request.
`benchmarks/v4_launch_variants.py` counts the builds a growing context asks for.
"""
from __future__ import annotations

import torch

from kvserve.cache.v4_specs import V4KVLayout
from kvserve.model.deepseek_v4.kernels.indexer import TOP_K_CONFIG, TopKBuild, score_width, top_k_indices
from kvserve.model.deepseek_v4.kernels.pages import V4PagedBatch


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
    out = torch.empty(1, k, dtype=torch.int32, device=device)
    for entries in bounds:
        batch = V4PagedBatch(out, V4KVLayout(1, 1, ()), [], seq_idx, positions, entries * rate)
        scores = torch.empty(1, score_width(entries * rate, rate), dtype=torch.float32, device=device)
        top_k_indices(scores, batch, rate, k, out)
    return len(bounds)
