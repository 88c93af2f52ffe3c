"""KV cache groups: which layers share one block table.

Owns the layer -> (group, slot) layout. Layers with equal specs share a group,
and every group has at most `group_size` layers, so the runner allocates
`group_size` KV tensors of shape [2, num_blocks, block_size, kv_heads, head_dim]
and layer `group.layer_ids[j]` of every group uses tensor j. One block id then
means the same memory in every group: the pool is fully fungible between
full-attention and sliding-window layers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.cache.specs import AttentionSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (and one attention spec)."""

    spec: AttentionSpec
    layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        if not self.layer_ids:
            raise ValueError("a KV cache group needs at least one layer")


def make_kv_cache_groups(layer_specs: Sequence[AttentionSpec]) -> list[KVCacheGroup]:
    """Group layers by spec, in chunks of `group_size` (the smallest spec count).

    A pure full-attention model gets one group of all layers. The last chunk of
    a spec may be shorter than `group_size`.
    """
    if not layer_specs:
        raise ValueError("the model has no attention layers to build KV cache groups for")
    layers_by_spec: dict[AttentionSpec, list[int]] = {}
    for layer_id, spec in enumerate(layer_specs):
        layers_by_spec.setdefault(spec, []).append(layer_id)
    size = min(len(layers) for layers in layers_by_spec.values())
    return [KVCacheGroup(spec, tuple(layers[i:i + size]))
            for spec, layers in layers_by_spec.items()
            for i in range(0, len(layers), size)]


def group_size(groups: Sequence[KVCacheGroup]) -> int:
    """How many KV tensors the runner allocates (one per slot)."""
    return max(len(group.layer_ids) for group in groups)


def layer_to_group(groups: Sequence[KVCacheGroup]) -> list[int]:
    mapping = _layer_map(groups)
    return [mapping[layer][0] for layer in range(len(mapping))]


def layer_to_slot(groups: Sequence[KVCacheGroup]) -> list[int]:
    """Index j of the KV tensor a layer uses: its position within its group."""
    mapping = _layer_map(groups)
    return [mapping[layer][1] for layer in range(len(mapping))]


def _layer_map(groups: Sequence[KVCacheGroup]) -> dict[int, tuple[int, int]]:
    mapping = {layer: (group_id, slot)
               for group_id, group in enumerate(groups)
               for slot, layer in enumerate(group.layer_ids)}
    num_layers = sum(len(group.layer_ids) for group in groups)
    if sorted(mapping) != list(range(num_layers)):
        raise ValueError(f"KV cache groups must cover layers 0..N-1 exactly once, "
                         f"got layers {sorted(mapping)}")
    return mapping
