"""CUDA graphs for decode steps.

Rules (SPEC; vLLM PR 41665): decode only; static input buffers; the largest
batch is captured first and all graphs share one memory pool; a batch is
padded to the next captured size; and nothing a graph reads is set up by a
branch that might be skipped at capture: every static buffer is fully
rewritten (real rows and padding rows) before every replay, and the captured
attention grid is planned for its context bucket's bound, so no launch shape
depends on the batch being replayed.

Each size is captured twice when `max_model_len` allows: for contexts up to
`SHORT_CONTEXT` and up to `max_model_len`. The decode kernel's split count
is planned from the bucket's bound, so a short batch replayed in a
long-context graph would launch many empty split programs and reduce over
them; its own graph plans few splits (none at large batch sizes, where the
kernel writes its output directly and the reduce is skipped). A batch
replays the graph of the smallest bucket that holds its longest sequence.
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from kvserve.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# Bound of the short-context graphs: the chat-turn and latency-test regime.
SHORT_CONTEXT = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to min(max_num_seqs, 512)."""
    limit = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit]
    sizes += list(range(16, limit + 1, 8))
    if limit not in sizes:
        sizes.append(limit)
    return sizes


def capture_graph(run, pool, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One warm-up run (Triton compiles and autotunes outside capture), then
    the capture of `run` into `pool`: (graph, its static output)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = run()
    return graph, output


class WorkLists:
    """The work-list decode's buffer for a kind of graph (`kernels/decode_work.py`): every graph's
    `DecodeWork` views it at its own sequence count, and each replay plans the list in full and
    rewrites the buffer where the plan changed (`write`)."""

    def __init__(self, num_kv_heads: int, num_sms: int, max_seqs: int, device: torch.device) -> None:
        self.shape = (num_kv_heads, num_sms)
        self.buffer = torch.zeros(2 * self.capacity(max_seqs) + 2 * max_seqs, dtype=torch.int32, device=device)
        self._held: tuple[int, np.ndarray | None] = (0, None)   # the capacity and splits the buffer holds

    @staticmethod
    def for_model(model: torch.nn.Module, max_seqs: int, device: torch.device) -> "WorkLists | None":
        """None for a model whose attention the work list does not serve (outside the Llama family)."""
        if not hasattr(model, "local_attention_heads"):
            return None
        from kvserve.attention.kernels.decode import sm_count
        return WorkLists(model.local_attention_heads[1], sm_count(device), max_seqs, device)

    def capacity(self, num_seqs: int) -> int:
        from kvserve.attention.kernels.decode_work import capacity
        return capacity(num_seqs, *self.shape)

    def views(self, num_seqs: int):
        from kvserve.attention.kernels.decode_work import DecodeWork
        return DecodeWork.views(self.buffer, num_seqs, self.capacity(num_seqs))

    def write(self, keys: np.ndarray, num_seqs: int) -> None:
        """The list for rows of `keys` keys (0: no item) over the graph of `num_seqs` rows.
        Written only where it differs from the list the buffer holds: the list depends on the
        capacity and the split counts alone (`work_layout`), and in a decode streak a row's
        count changes only when its keys cross a chunk's multiple (8 steps in 128 at 24
        ide-completion rows, 1 at 256). This is the buffer's only writer, so what it holds is
        the last write's list, whatever was captured or replayed since."""
        from kvserve.attention.kernels.decode_work import plan_splits, work_layout
        from kvserve.runner.staging import upload
        cap = self.capacity(num_seqs)
        splits = plan_splits(keys, *self.shape, cap)
        if cap == self._held[0] and np.array_equal(splits, self._held[1]):
            return
        plan = work_layout(splits, cap)
        self.buffer[:len(plan)].copy_(upload(torch.from_numpy(plan), self.buffer.device))
        self._held = (cap, splits)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, num_groups: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, device: torch.device, cascade: bool = False, work: bool = False) -> None:
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.buckets = sorted({min(SHORT_CONTEXT, max_model_len), max_model_len})
        n = self.sizes[-1]
        width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros(n, width, dtype=torch.int32, device=device) for _ in range(num_groups)]
        # Padding rows have slot -1: the cache write skips them, so the null
        # block's slot 0 stays zero (the torch backend gathers masked keys there).
        self.slot_mappings = [torch.full((n,), -1, dtype=torch.long, device=device) for _ in range(num_groups)]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        # Replays per (size, bucket): tests assert graphs ran, not merely exist.
        self.num_replays: dict[tuple[int, int], int] = {}
        # Shared-prefix decode (`kernels/cascade.py`): each graph plans `graph_groups(size)` groups
        # over these buffers, which `run` rewrites from the step's groups.
        self.cascade = None
        if cascade:
            from kvserve.attention.kernels.cascade import CascadeBuffers, MAX_GRAPH_GROUPS
            self.cascade = CascadeBuffers(n, MAX_GRAPH_GROUPS, width, device)
        # Work-list decode (`kernels/decode_work.py`), rewritten by `run` from the step's key counts.
        self.work = WorkLists.for_model(model, n, device) if work else None

    def _meta(self, size: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=size, num_tokens=size, block_size=self.block_size,
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=[t[:size] for t in self.block_tables],
            slot_mappings=[s[:size] for s in self.slot_mappings],
            max_query_len=1, max_seq_len=max_seq_len,
            query_lens_cpu=[1] * size, seq_lens_cpu=[max_seq_len] * size,
            cascade=self._cascade_plan(size), decode_work=self.work and self.work.views(size))

    def _cascade_plan(self, size: int):
        if self.cascade is None:
            return None
        from kvserve.attention.kernels.cascade import graph_groups
        return self.cascade.plan(size, graph_groups(size))

    @torch.inference_mode()
    def capture(self, pool) -> None:
        stream = torch.cuda.Stream()
        # Largest first: later graphs reuse its pool.
        for key in [(size, bucket) for size in reversed(self.sizes) for bucket in reversed(self.buckets)]:
            size, bucket = key
            if self.work is not None:   # a valid list to capture over: one key, one split a row
                self.work.write(np.ones(size, dtype=np.int64), size)
            run = lambda: self.model(self.input_ids[:size], self.positions[:size],  # noqa: E731
                                     self._meta(size, bucket))
            self.graphs[key], self.outputs[key] = capture_graph(run, pool, stream)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d, context buckets %s)",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.buckets)

    def _write_cascade(self, cascade, n: int, size: int) -> None:
        from kvserve.attention.kernels.cascade import graph_groups
        groups, table = cascade if cascade is not None else ([], None)
        self.cascade.write(groups, table, n, self.block_size, limit=graph_groups(size))

    def padded_size(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, device_tables: list[torch.Tensor], slots: list[torch.Tensor],
            input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
            max_seq_len: int, cascade: tuple | None = None, host_lens=None) -> torch.Tensor:
        """Replay for a decode batch; every static buffer row up to the padded size is rewritten.
        `cascade`: the step's shared-prefix groups and its host block table (graphs captured
        with cascade only; none: every sequence ungrouped). `host_lens`: the rows' key counts on
        the host (graphs captured with a work list)."""
        n = input_ids.shape[0]  # decode: one token per sequence
        size = self.padded_size(n)
        if self.cascade is not None:
            self._write_cascade(cascade, n, size)
        if self.work is not None:   # padding rows: one key each
            self.work.write(np.concatenate([host_lens[:n], np.ones(size - n, dtype=np.int64)]), size)
        bucket = self.buckets[bisect.bisect_left(self.buckets, max_seq_len)]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:size].fill_(1)
        for static, table, static_slots, slot in zip(self.block_tables, device_tables, self.slot_mappings, slots):
            static[:n, :table.shape[1]].copy_(table)
            static[:n, table.shape[1]:].zero_()
            static[n:size].zero_()
            static_slots[:n].copy_(slot)
            static_slots[n:size].fill_(-1)
        self.graphs[size, bucket].replay()
        self.num_replays[size, bucket] = self.num_replays.get((size, bucket), 0) + 1
        return self.outputs[size, bucket][:n]
