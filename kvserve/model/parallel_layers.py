"""Tensor-parallel layers: the row-parallel linear (the per-layer all-reduce),
the vocab-parallel embedding and the vocab-parallel LM head.

Column-parallel projections (fused qkv, fused gate/up) need no class: each
rank's `nn.Linear` simply has its share of output rows, and its output stays
sharded into the next row-parallel layer. The factories below return the
plain single-GPU module when there is no group, so one rank runs exactly the
code it ran before tensor parallelism existed.

Parameter names match `nn.Linear` / `nn.Embedding` (`weight`, `bias`), so
checkpoint names map the same way at any tensor-parallel size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from kvserve.distributed.group import TPGroup
    from kvserve.distributed.sharding import TPShard


class RowParallelLinear(nn.Module):
    """y = sum over ranks of (x_r @ W_r^T), + bias once: the input's last
    dimension is split across ranks, the output is whole on every rank."""

    def __init__(self, local_in: int, out: int, bias: bool, group: "TPGroup") -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out, local_in))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [first, first + rows) of the table; a token outside
    them embeds to zeros here, and the all-reduce takes it from its owner."""

    def __init__(self, shard: "TPShard", hidden: int, group: "TPGroup") -> None:
        super().__init__()
        self.group = group
        self.first, self.num_real = shard.vocab_rows.start, len(shard.vocab_rows)
        self.weight = nn.Parameter(torch.empty(shard.vocab_rows_per_rank, hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered on rank 0: there they
    are the full [N, vocab] logits; other ranks get back their own shard.
    A serving driver first announces the rows to the workers (the group's
    `announce_logits`), so any caller's logits are computed on every rank."""

    def __init__(self, shard: "TPShard", hidden: int, group: "TPGroup") -> None:
        super().__init__()
        self.group = group
        self.vocab_size = shard.vocab_size
        self.weight = nn.Parameter(torch.empty(shard.vocab_rows_per_rank, hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.group.announce_logits is not None:
            self.group.announce_logits(hidden)
        local = F.linear(hidden, self.weight)
        shards = self.group.gather(local)
        if shards is None:
            return local
        return torch.cat(shards, dim=-1)[..., :self.vocab_size]


def row_parallel_linear(local_in: int, out: int, bias: bool, group: "TPGroup | None") -> nn.Module:
    if group is None:
        return nn.Linear(local_in, out, bias=bias)
    return RowParallelLinear(local_in, out, bias, group)


def embedding(shard: "TPShard", hidden: int, group: "TPGroup | None") -> nn.Module:
    if group is None:
        return nn.Embedding(shard.vocab_size, hidden)
    return VocabParallelEmbedding(shard, hidden, group)


def lm_head(shard: "TPShard", hidden: int, group: "TPGroup | None") -> nn.Module:
    if group is None:
        return nn.Linear(hidden, shard.vocab_size, bias=False)
    return ParallelLMHead(shard, hidden, group)
