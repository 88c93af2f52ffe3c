"""DeepSeek V4 attention specs and the V4 KV layout: which groups, and what a
block of each group holds.

Every group shares the scheduler's token grid (table slot i covers tokens
[i*B, (i+1)*B)), so hits, hashing and allocation stay the generic code; what
differs is the page:
  * sliding K=V: B tokens x head_dim per layer (window, freed as it moves);
  * compressor state: B tokens of raw (kv, gate) per layer, kept for a window of
    2*rate tokens (CSA: the open window and its overlap) or rate (HCA), so a
    prefix hit restores the state exactly from cached blocks;
  * compressed entries: the entries whose windows end in the slot (CSA: B/4
    entries of head_dim + index_head_dim, i.e. entry and indexer key; HCA: one
    per 128 tokens, slots without one hold the NULL block).
All pages are one unit of the pool; a group packs as many layers of its kind
as fit in a unit, so no page is padded to the largest kind. The unit is the
largest single-layer page, or a page of all layers of one kind when that
stores a 64K-token sequence in fewer bytes (V4-Flash: all 20 CSA layers'
entries in one page instead of 16 + 4).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvserve.cache.groups import KVCacheGroup
from kvserve.cache.specs import SlidingWindowSpec


@dataclass(frozen=True)
class CompressorStateSpec:
    """Raw compressor inputs of the last `window` tokens (a sliding window of state)."""
    rate: int
    overlap: bool

    def __post_init__(self) -> None:
        if self.rate < 1:
            raise ValueError(f"compress rate must be >= 1, got {self.rate}")

    @property
    def window(self) -> int:
        return (2 if self.overlap else 1) * self.rate

    @property
    def sink(self) -> int:
        return 0

    def visible_start(self, query_pos: int) -> int:
        return max(0, query_pos - self.window + 1)

    def describe(self) -> str:
        return f"compressor_state(rate={self.rate}, window={self.window})"


@dataclass(frozen=True)
class CompressedSpec:
    """One entry per `rate` tokens, all kept (prefix-closed, like full attention)."""
    rate: int
    with_index_keys: bool

    def __post_init__(self) -> None:
        if self.rate < 1:
            raise ValueError(f"compress rate must be >= 1, got {self.rate}")

    def visible_start(self, query_pos: int) -> int:
        return 0

    @property
    def sink(self) -> int:
        return 0

    def holds_entry(self, index: int, block_size: int) -> bool:
        """Whether table slot `index` holds the end of some window."""
        return (index + 1) * block_size // self.rate > index * block_size // self.rate

    def entries_per_block(self, block_size: int) -> int:
        return max(1, block_size // self.rate)

    def describe(self) -> str:
        return f"compressed(1/{self.rate}{', +index keys' if self.with_index_keys else ''})"


@dataclass(frozen=True)
class V4PageKind:
    """One kind of V4 page: per layer, `rows` x `width` values per block."""
    name: str  # sliding | csa_state | hca_state | csa_entries | hca_entries
    spec: object
    rows: int
    width: int

    @property
    def layer_page(self) -> int:
        return self.rows * self.width


@dataclass(frozen=True)
class V4GroupLayout:
    kind: V4PageKind
    group: KVCacheGroup

    def slot(self, layer: int) -> int:
        return self.group.layer_ids.index(layer)


@dataclass(frozen=True)
class V4KVLayout:
    block_size: int
    unit: int  # values per block (one page of any group)
    groups: tuple[V4GroupLayout, ...]

    def kv_groups(self) -> list[KVCacheGroup]:
        return [g.group for g in self.groups]

    @cached_property
    def _index(self) -> dict[tuple[str, int], int]:
        return {(g.kind.name, layer): group_id for group_id, g in enumerate(self.groups)
                for layer in g.group.layer_ids}

    def find(self, kind: str, layer: int) -> tuple[int, V4GroupLayout]:
        """(group id, group) holding `layer`'s pages of `kind`; KeyError if none."""
        group_id = self._index[(kind, layer)]
        return group_id, self.groups[group_id]

    def compressed_kind(self, layer: int) -> str | None:
        """"csa", "hca" or None (sliding only) for a layer."""
        return next((k for k in ("csa", "hca") if (f"{k}_entries", layer) in self._index), None)

    def blocks_per_sequence(self, context: int, chunk: int = 1) -> dict[str, int]:
        """Peak blocks one sequence of `context` tokens holds per page kind
        (sliding and state groups: their window plus the step's chunk)."""
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.kind.name] = out.get(g.kind.name, 0) + _blocks(g.kind.spec, self.block_size, context, chunk)
        return out

    def bytes_per_token(self, context: int, dtype_bytes: int, chunk: int = 1) -> float:
        """KV bytes per token of context for one sequence (windows included)."""
        blocks = sum(self.blocks_per_sequence(context, chunk).values())
        return blocks * self.unit * dtype_bytes / context

    def long_run_bytes_per_token(self, dtype_bytes: int) -> dict[str, float]:
        """Bytes per token of the groups that grow with the context (compressed entries)."""
        out: dict[str, float] = {}
        for g in self.groups:
            if isinstance(g.kind.spec, CompressedSpec):
                span = max(self.block_size, g.kind.spec.rate)  # tokens per real block
                out[g.kind.name] = out.get(g.kind.name, 0.0) + self.unit * dtype_bytes / span
        return out


def _blocks(spec, block_size: int, context: int, chunk: int) -> int:
    if isinstance(spec, CompressedSpec):
        return sum(1 for i in range(-(-context // block_size)) if spec.holds_entry(i, block_size))
    bounded = -(-(spec.window - 2 + chunk) // block_size) + 1  # as SlidingWindowManager.max_blocks
    return min(-(-context // block_size), bounded)


def v4_kv_layout(config, block_size: int) -> V4KVLayout:
    """Groups and pages for a `DeepseekV4Config` at `block_size` tokens per slot."""
    c = config
    if block_size % 4 and any(t != "sliding_attention" for t in c.layer_types):
        raise ValueError(f"DeepSeek V4 compressed layers need block_size to be a multiple of the CSA rate 4, "
                         f"got {block_size}")
    kinds = _page_kinds(c, block_size)
    smallest = max(kind.layer_page for kind, _ in kinds)
    # Candidate units: the largest layer page, or a page holding all layers of one
    # kind; keep the one that stores a 64K-token sequence in the fewest bytes.
    candidates = {smallest} | {len(layers) * kind.layer_page for kind, layers in kinds
                               if len(layers) * kind.layer_page > smallest}
    layouts = [_packed(kinds, block_size, unit) for unit in sorted(candidates)]
    return min(layouts, key=lambda layout: layout.bytes_per_token(LAYOUT_CONTEXT, 1))


LAYOUT_CONTEXT = 65536


def _packed(kinds, block_size: int, unit: int) -> V4KVLayout:
    groups = []
    for kind, layers in kinds:
        per_page = max(1, unit // kind.layer_page)
        groups += [V4GroupLayout(kind, KVCacheGroup(kind.spec, layers[i:i + per_page]))
                   for i in range(0, len(layers), per_page)]
    return V4KVLayout(block_size, unit, tuple(groups))


def _page_kinds(c, block_size: int) -> list[tuple[V4PageKind, tuple[int, ...]]]:
    d, di = c.head_dim, c.index_head_dim
    csa = tuple(i for i, t in enumerate(c.layer_types) if t == "compressed_sparse_attention")
    hca = tuple(i for i, t in enumerate(c.layer_types) if t == "heavily_compressed_attention")
    rc, rh = c.compress_rate("compressed_sparse_attention"), c.compress_rate("heavily_compressed_attention")
    kinds = [(V4PageKind("sliding", SlidingWindowSpec(c.sliding_window), block_size, d),
              tuple(range(c.num_hidden_layers)))]
    if csa:
        entries = CompressedSpec(rc, True)
        kinds += [(V4PageKind("csa_state", CompressorStateSpec(rc, True), block_size, 4 * d + 4 * di), csa),
                  (V4PageKind("csa_entries", entries, entries.entries_per_block(block_size), d + di), csa)]
    if hca:
        entries = CompressedSpec(rh, False)
        kinds += [(V4PageKind("hca_state", CompressorStateSpec(rh, False), block_size, 2 * d), hca),
                  (V4PageKind("hca_entries", entries, entries.entries_per_block(block_size), d), hca)]
    return kinds
