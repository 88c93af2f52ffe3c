"""What a V4 attention layer reads about a sequence's past, and writes back.

`SequenceKV` is the interface: per layer, the sliding K=V keys before the
step, the raw compressor inputs (kv, gate) of the current partial window
(plus, for CSA, the window before it: the overlap), and the compressed
entries emitted so far. `DenseSequenceKV` keeps them as growing tensors per
request; an uncached forward is a fresh `DenseSequenceKV`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerPast:
    """One layer's past for one sequence (positions before the step)."""
    sliding_kv: torch.Tensor                   # [k, d] keys at positions start..p0-1
    sliding_start: int
    raw: dict[str, tuple[torch.Tensor, torch.Tensor, int]]  # name -> (kv, gate, first_pos), up to p0
    entries: dict[str, torch.Tensor]           # name -> [E, d] entries emitted so far


class DenseSequenceKV:
    """A request's V4 past as plain tensors (the reference layout).

    Keeps every sliding key and every raw compressor input: simple and exact,
    used for uncached forwards and as the model-side reference for paged caches.
    """

    def __init__(self) -> None:
        self.layers: dict[int, LayerPast] = {}

    def past(self, layer: int, names: tuple[str, ...], like: torch.Tensor, dims: dict[str, tuple[int, int]]) -> LayerPast:
        if layer not in self.layers:
            self.layers[layer] = LayerPast(
                like.new_zeros((0, like.shape[-1])), 0,
                {n: (like.new_zeros((0, dims[n][0])), like.new_zeros((0, dims[n][0])), 0) for n in names},
                {n: like.new_zeros((0, dims[n][1])) for n in names})
        return self.layers[layer]

    def append(self, layer: int, sliding_kv: torch.Tensor, raw: dict[str, tuple[torch.Tensor, torch.Tensor]],
               entries: dict[str, torch.Tensor]) -> None:
        past = self.layers[layer]
        past.sliding_kv = torch.cat([past.sliding_kv, sliding_kv])
        for name, (kv, gate) in raw.items():
            old_kv, old_gate, first = past.raw[name]
            past.raw[name] = (torch.cat([old_kv, kv]), torch.cat([old_gate, gate]), first)
        for name, new in entries.items():
            past.entries[name] = torch.cat([past.entries[name], new])
