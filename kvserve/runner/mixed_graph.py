"""CUDA graphs for mixed steps: prefill chunks and decodes in one batch.

Under live load nearly every step is mixed (a new prompt's chunk beside the
running decodes), so decode-only graphs leave most steps to eager launches
of every layer's kernels. A mixed graph is captured per token bucket (the
padded token count of the step); its sequence capacity is
min(max_num_seqs, bucket). The varlen attention kernel runs with a fixed
grid that reads each program's (sequence, query tile) from a tile table, and
the decode kernel (the batch's one-query rows, `attention/kernels/mixed.py`)
with a grid over the sequence capacity planned for `max_model_len`, so no
launch shape depends on the batch being replayed.

Capture discipline (SPEC; vLLM PR 41665): every static buffer a graph reads
is rewritten before every replay, real rows and padding alike: padding
tokens get slot -1 (the cache write skips them), padding sequences get an
empty query, and tile-table entries past the batch's tiles get sequence -1
(their programs exit). Steps above the largest bucket run eagerly: there
the GPU time of the step dwarfs its launch overhead.
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from kvserve.attention.kernels.prefill import PrefillConfig, tile_table
from kvserve.attention.metadata import AttentionMetadata, PrefillTiles
from kvserve.runner.cuda_graph import WorkLists, capture_graph
from kvserve.runner.staging import upload

logger = logging.getLogger(__name__)

# Prompt chunks a step may carry beyond its token count's full query tiles
# (each adds at most one partial tile). Every tile-table entry launches
# programs, idle or not: at 66 entries (one per sequence of a 64-token
# bucket) the varlen kernel's idle programs alone took ~20 us a layer on an
# H200. A step with more chunks takes a larger bucket, or runs eagerly.
CHUNK_TILES = 8

# Largest captured step. Padding to a bucket costs compute that grows with
# the step, while launch overhead stays fixed: past ~2K tokens the step's
# GPU time hides the launches anyway.
MAX_MIXED_GRAPH_TOKENS = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: fine steps while launches dominate, then 128 apart."""
    limit = min(max_tokens, MAX_MIXED_GRAPH_TOKENS)
    sizes = [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, *range(640, 2049, 128)]
    sizes = [s for s in sizes if s <= limit]
    if limit >= 16 and limit not in sizes:
        sizes.append(limit)
    return sizes


class MixedGraphs:
    def __init__(self, model: torch.nn.Module, num_groups: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, device: torch.device, work: bool = False) -> None:
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.buckets = token_buckets(max_num_batched_tokens)
        # This rank's heads: under tensor parallelism the attention layers see only their share.
        self.block_q = PrefillConfig().block_q(*model.local_attention_heads)
        t, s = self.buckets[-1], self.seq_capacity(self.buckets[-1])
        width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        self.slot_mappings = [torch.full((t,), -1, dtype=torch.long, device=device) for _ in range(num_groups)]
        self.query_start_loc = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(s, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros(s, width, dtype=torch.int32, device=device) for _ in range(num_groups)]
        self.tile_seq = torch.full((self.tile_capacity(t),), -1, dtype=torch.int32, device=device)
        self.tile_q = torch.zeros(self.tile_capacity(t), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays: dict[int, int] = {}
        # Work-list decode of the one-query rows (`kernels/decode_work.py`), rewritten by `run`.
        self.work = WorkLists.for_model(model, s, device) if work else None

    def seq_capacity(self, bucket: int) -> int:
        return min(self.max_num_seqs, bucket)

    def tile_capacity(self, bucket: int) -> int:
        """Query tiles a step of `bucket` tokens may have: the full ones plus
        one partial tile for each of up to CHUNK_TILES prompt chunks."""
        return -(-bucket // self.block_q) + min(self.seq_capacity(bucket), CHUNK_TILES)

    def bucket_for(self, num_tokens: int, num_seqs: int, num_tiles: int) -> int | None:
        """Smallest captured bucket holding the step's tokens, sequences and
        query tiles, or None (run eagerly)."""
        i = bisect.bisect_left(self.buckets, max(num_tokens, num_seqs))
        while i < len(self.buckets) and num_tiles > self.tile_capacity(self.buckets[i]):
            i += 1
        if i == len(self.buckets) or num_seqs > self.seq_capacity(self.buckets[i]):
            return None
        return self.buckets[i]

    def _meta(self, bucket: int) -> AttentionMetadata:
        s = self.seq_capacity(bucket)
        tiles = self.tile_capacity(bucket)
        return AttentionMetadata(
            num_seqs=s, num_tokens=bucket, block_size=self.block_size,
            query_start_loc=self.query_start_loc[:s + 1], seq_lens=self.seq_lens[:s],
            block_tables=[t[:s] for t in self.block_tables],
            slot_mappings=[m[:bucket] for m in self.slot_mappings],
            # Bounds only: the kernels read the tile table and device lengths.
            max_query_len=bucket, max_seq_len=self.max_model_len,
            query_lens_cpu=[], seq_lens_cpu=[],
            prefill_tiles=PrefillTiles(self.tile_seq[:tiles], self.tile_q[:tiles]),
            decode_work=self.work and self.work.views(s))

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Largest bucket first, so smaller graphs reuse its memory in `pool`."""
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            if self.work is not None:   # a valid list to capture over: no items
                self.work.write(np.zeros(self.seq_capacity(bucket), dtype=np.int64), self.seq_capacity(bucket))
            run = lambda: self.model(self.input_ids[:bucket], self.positions[:bucket],  # noqa: E731
                                     self._meta(bucket))
            self.graphs[bucket], self.outputs[bucket] = capture_graph(run, pool, stream)
        torch.cuda.synchronize()
        logger.info("captured %d mixed-step CUDA graphs (%d..%d tokens)", len(self.graphs),
                    self.buckets[0], self.buckets[-1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | None:
        """Replay the bucket's graph for a mixed batch: hidden states [T, hidden],
        or None where no captured bucket holds the step (run it eagerly)."""
        n, s = meta.num_tokens, meta.num_seqs
        # The decode kernel attends the one-query rows: no tile programs for them.
        tiles = tile_table(torch.from_numpy(np.asarray(meta.query_lens_cpu, dtype=np.int32)),
                           self.block_q, skip_single=True)
        bucket = self.bucket_for(n, s, tiles[0].shape[0])
        if bucket is None:
            return None
        self._write_tokens(n, bucket, input_ids, positions, meta.slot_mappings)
        self._write_seqs(s, self.seq_capacity(bucket), n, meta)
        self._write_tiles(tiles, self.tile_capacity(bucket))
        if self.work is not None:   # items for the one-query rows only
            capacity = self.seq_capacity(bucket)
            keys = np.zeros(capacity, dtype=np.int64)
            keys[:s] = np.where(np.asarray(meta.query_lens_cpu) == 1, meta.seq_lens_cpu, 0)
            self.work.write(keys, capacity)
        self.graphs[bucket].replay()
        self.num_replays[bucket] = self.num_replays.get(bucket, 0) + 1
        return self.outputs[bucket][:n]

    def _write_tokens(self, n: int, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor,
                      slots: list[torch.Tensor]) -> None:
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:bucket].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:bucket].zero_()
        for static, slot in zip(self.slot_mappings, slots):
            static[:n].copy_(slot)
            static[n:bucket].fill_(-1)

    def _write_seqs(self, s: int, capacity: int, n: int, meta: AttentionMetadata) -> None:
        self.query_start_loc[:s + 1].copy_(meta.query_start_loc)
        self.query_start_loc[s + 1:capacity + 1].fill_(n)  # padding sequences: empty queries
        self.seq_lens[:s].copy_(meta.seq_lens)
        self.seq_lens[s:capacity].fill_(1)
        for static, table in zip(self.block_tables, meta.block_tables):
            static[:s, :table.shape[1]].copy_(table)
            static[:s, table.shape[1]:].zero_()
            static[s:capacity].zero_()

    def _write_tiles(self, tiles: tuple[torch.Tensor, torch.Tensor], capacity: int) -> None:
        seq, q_tile = tiles
        k = seq.shape[0]
        device = self.tile_seq.device
        self.tile_seq[:k].copy_(upload(seq, device))
        self.tile_seq[k:capacity].fill_(-1)
        self.tile_q[:k].copy_(upload(q_tile, device))
