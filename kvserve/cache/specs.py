"""Attention specs: what a layer needs from the KV cache.

A spec is a frozen value; layers with equal specs share one KV cache group.
Adding an attention type means adding a spec here and a manager in
`managers.py`, never `if` branches in generic code.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    """Causal attention over the whole sequence."""

    def visible_start(self, query_pos: int) -> int:
        """First key position (outside any sink) a query at `query_pos` can see."""
        return 0

    @property
    def sink(self) -> int:
        return 0

    def describe(self) -> str:
        return "full"


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Causal attention to the last `window` keys plus the first `sink` keys.

    A query at position p sees key k when k <= p and (p - k < window or k < sink).
    `window` counts the query's own position, matching HF transformers' masks.
    """

    window: int
    sink: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")
        if self.sink < 0:
            raise ValueError(f"attention sink size must be >= 0, got {self.sink}")

    def visible_start(self, query_pos: int) -> int:
        return max(0, query_pos - self.window + 1)

    def describe(self) -> str:
        return f"sliding(window={self.window}, sink={self.sink})"


AttentionSpec = FullAttentionSpec | SlidingWindowSpec
