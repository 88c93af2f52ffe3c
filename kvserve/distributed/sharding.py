"""Tensor-parallel sharding math for the Llama family: which rows or columns
of each checkpoint tensor one rank holds. Pure arithmetic, no communication.

Rank r of N holds
  - query heads [r*H/N, (r+1)*H/N) (q rows, o_proj columns);
  - KV heads [r*KVH/N, (r+1)*KVH/N) when N divides KVH; when KVH divides N,
    the one KV head its query heads read, head floor(r*KVH/N): each KV head
    is then replicated on N/KVH ranks (k/v rows, and its KV cache);
  - intermediate rows [r*I/N, (r+1)*I/N) of gate and of up, the same
    columns of down_proj;
  - vocabulary rows [r*ceil(V/N), ...) of the embedding and the LM head, the
    last rank's shard padded with rows that no token selects.
Norms, q/k norms and the o_proj bias are replicated (the bias is added once,
after the all-reduce).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.config import ModelConfig

# Checkpoint projections split along their input (column) dimension; the
# others are split along rows.
_COLUMN_SPLIT = ("o_proj", "down_proj")
_VOCAB_SPLIT = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class Slice:
    """Entries [start, stop) along dimension `dim` of a checkpoint tensor."""
    dim: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def narrow(tensor: torch.Tensor, part: Slice | None) -> torch.Tensor:
    """`tensor` cut to `part` (a view), or whole when `part` is None."""
    return tensor if part is None else tensor.narrow(part.dim, part.start, part.length)


def validate_tp(config: ModelConfig, size: int) -> None:
    """Raise ValueError (naming the values) if `config` cannot be split over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"num_attention_heads ({heads}) must be divisible by "
                         f"tensor_parallel_size ({size})")
    if config.intermediate_size % size:
        raise ValueError(f"intermediate_size ({config.intermediate_size}) must be divisible by "
                         f"tensor_parallel_size ({size})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"num_key_value_heads ({kv_heads}) must be divisible by "
                         f"tensor_parallel_size ({size}) or divide it (KV heads are then replicated)")


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: its heads, intermediate rows and vocabulary rows."""
    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> "TPShard":
        validate_tp(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        return cls(rank, size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                   config.intermediate_size, config.vocab_size)

    # -- heads ---------------------------------------------------------------
    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def q_heads(self) -> range:
        return range(self.rank * self.num_local_heads, (self.rank + 1) * self.num_local_heads)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads: its own share, or the replicated head its queries read."""
        first = self.rank * self.num_kv_heads // self.size
        return range(first, first + self.num_local_kv_heads)

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless KV heads are fewer than ranks)."""
        return max(1, self.size // self.num_kv_heads)

    # -- MLP and vocabulary ----------------------------------------------------------
    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate_size // self.size

    @property
    def intermediate_rows(self) -> range:
        n = self.local_intermediate_size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_rows_per_rank(self) -> int:
        """Rows of every rank's embedding / LM head shard (padding included)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_rows(self) -> range:
        """The vocabulary ids this rank holds (the last rank may hold fewer)."""
        n = self.vocab_rows_per_rank
        return range(min(self.rank * n, self.vocab_size), min((self.rank + 1) * n, self.vocab_size))

    # -- checkpoint tensors ---------------------------------------------------------
    def checkpoint_slice(self, hf_name: str) -> Slice | None:
        """The part of checkpoint tensor `hf_name` this rank loads; None: all of it."""
        if self.size == 1:
            return None
        module, _, leaf = hf_name.rpartition(".")
        proj = module.rpartition(".")[2]
        rows = self._rows_of(proj)
        if rows is None or (proj in _COLUMN_SPLIT and leaf == "bias"):
            return None
        dim = 1 if proj in _COLUMN_SPLIT else 0
        return Slice(dim, rows.start, rows.stop)

    def _rows_of(self, proj: str) -> range | None:
        d = self.head_dim
        if proj in ("q_proj", "o_proj"):
            return range(self.q_heads.start * d, self.q_heads.stop * d)
        if proj in ("k_proj", "v_proj"):
            return range(self.kv_heads.start * d, self.kv_heads.stop * d)
        if proj in ("gate_proj", "up_proj", "down_proj"):
            return self.intermediate_rows
        if proj in _VOCAB_SPLIT:
            return self.vocab_rows
        return None
