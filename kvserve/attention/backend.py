"""The attention-backend interface and its registry.

A backend owns two things for one attention layer: writing the step's new K/V
into the paged cache (by slot mapping) and computing attention of the step's
queries over the paged cache (by block table), honouring the layer's spec
(full, sliding window, sink + window). Models never see blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.specs import AttentionSpec


@dataclass(frozen=True)
class AttentionLayerInfo:
    layer_idx: int
    group_id: int          # index into metadata.block_tables / slot_mappings
    spec: AttentionSpec
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, layer: AttentionLayerInfo,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D].

        Writes k, v at meta.slot_mappings[layer.group_id], then returns the
        attention output [T, H, D].
        """
        ...


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str) -> Callable:
    def wrap(factory: Callable[[], AttentionBackend]) -> Callable[[], AttentionBackend]:
        _REGISTRY[name] = factory
        return factory
    return wrap


def get_backend(name: str) -> AttentionBackend:
    _import_builtin_backends()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def _import_builtin_backends() -> None:
    import kvserve.attention.torch_ref  # noqa: F401
    try:
        import kvserve.attention.triton_backend  # noqa: F401
    except ImportError:  # Triton absent: the torch reference still works.
        pass
