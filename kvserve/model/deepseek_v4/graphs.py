"""CUDA graphs for DeepSeek V4 steps, decode and mixed (prefill chunks beside
decodes), and the static input buffers they read.

Every V4 kernel is flat over tokens: a token finds its sequence through
`seq_idx` (-1: padding, which every kernel skips) and its pages through the
block tables, so a decode step and a mixed step launch the same kernels. One
graph is captured per (token bucket, context bucket); a step replays the
graph of the smallest token bucket holding its tokens and the smallest
context bucket holding its longest sequence. Larger steps run eagerly.

Capture discipline (SPEC; vLLM PR 41665, where a memset behind a length
check was never captured and replays read stale top-k state):
  * every input a graph reads (token ids, positions, seq_idx, block tables)
    is a static buffer rewritten in full, up to the bucket, before every run:
    padding tokens get sequence -1 and position 0, padding table rows and
    columns the null block 0, so padding never reads or writes a real page;
  * kernel bounds (`V4PagedBatch.max_seq_len`: the indexer's score rows and
    top-k tile, the split-KV plan) are the context bucket's bound, never the
    step's data, so no launch shape depends on the batch replayed;
  * tensors derived from the inputs (window rope) are recomputed inside every
    forward (`forward_tokens` empties the batch scratch), and the top-k index
    and attention outputs are written in full by their kernels every step;
  * the forward must not synchronise the host: a probe run with synchronising
    CUDA calls turned into errors finds one before capture, and graphs stay
    off (with a warning) rather than bake in values read at capture.

The static-buffer forward also runs without capture (`run` when the key was
not captured): the CPU tests check the padded path that way under the Triton
interpreter.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.cache.v4_specs import V4KVLayout
from kvserve.runner.cuda_graph import capture_sizes as decode_capture_sizes

if TYPE_CHECKING:  # the kernels import Triton: only the "triton" backend needs them
    from kvserve.model.deepseek_v4.kernels import V4PagedBatch

logger = logging.getLogger(__name__)

# Bound of the short-context graphs. The indexer's top-k tile and score grid
# are planned from the bound: at 8K the tile is 2,048 entries, at 64K+ 16,384.
SHORT_CONTEXT = 8192
# Largest mixed step captured (as the generic mixed graphs): past it the
# step's GPU time hides its launches.
MAX_GRAPH_TOKENS = 2048
# Most sequences a graph holds: the static tables are rows x max_model_len /
# block_size ids per group (1.2 GB for 9 groups at 1M tokens).
MAX_GRAPH_SEQS = 512


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, mixed: bool) -> list[int]:
    """Token buckets: the decode sizes (1, 2, 4, 8, then every 8 up to 512
    sequences) and, with `mixed`, coarser ones up to MAX_GRAPH_TOKENS."""
    sizes = set(decode_capture_sizes(min(max_num_seqs, max_num_batched_tokens)))  # Llama's decode buckets
    if mixed:
        top = min(max_num_batched_tokens, MAX_GRAPH_TOKENS)
        sizes |= {s for s in (16, 32, 64, 128, 256, 384, 512) if s <= top}
        sizes |= set(range(640, top + 1, 128)) | {top}
    return sorted(sizes)


def context_buckets(max_model_len: int) -> list[int]:
    return sorted({min(SHORT_CONTEXT, max_model_len), max_model_len})


@dataclass(frozen=True)
class V4Step:
    """One step's device inputs, as the eager forward reads them."""
    input_ids: torch.Tensor           # [T] int64
    positions: torch.Tensor           # [T] int64
    seq_idx: torch.Tensor             # [T] int32
    block_tables: list[torch.Tensor]  # per group [S, W_g] int32
    num_seqs: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class StaticInputs:
    """The buffers every V4 graph reads, and their full rewrite before a run."""

    def __init__(self, num_groups: int, max_tokens: int, max_seqs: int, max_width: int,
                 device: torch.device) -> None:
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        # All padding until the first load: a capture of this state touches no page.
        self.seq_idx = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_groups, max_seqs, max_width, dtype=torch.int32, device=device)

    def load(self, step: V4Step, size: int, width: int) -> None:
        """Rows [0, size) of every buffer, and table columns [0, width): the
        step's values, padding everywhere else. Unconditional: a row the step
        does not fill still gets written."""
        n = step.num_tokens
        self.input_ids[:n].copy_(step.input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(step.positions)
        self.positions[n:size].zero_()
        self.seq_idx[:n].copy_(step.seq_idx)
        self.seq_idx[n:size].fill_(-1)
        self.block_tables[:, :min(size, self.block_tables.shape[1]), :width].zero_()
        for static, table in zip(self.block_tables, step.block_tables):
            # Columns past the bucket's width hold no position below its bound: never read.
            cols = min(width, table.shape[1])
            static[:table.shape[0], :cols].copy_(table[:, :cols])

    def batch(self, storage: torch.Tensor, layout: V4KVLayout, size: int, bound: int) -> "V4PagedBatch":
        from kvserve.model.deepseek_v4.kernels import V4PagedBatch
        width = -(-bound // layout.block_size)
        return V4PagedBatch(storage, layout, list(self.block_tables[:, :, :width].unbind(0)),
                            self.seq_idx[:size], self.positions[:size], bound)


class V4Graphs:
    """Static buffers, one `V4PagedBatch` per (token bucket, context bucket),
    and the graphs captured over them (none on the CPU: `run` then runs the
    same static forward eagerly)."""

    def __init__(self, model: torch.nn.Module, storage: torch.Tensor, layout: V4KVLayout,
                 sizes: list[int], bounds: list[int], max_num_seqs: int, mixed: bool) -> None:
        self.model, self.layout, self.mixed = model, layout, mixed
        self.sizes, self.bounds = sorted(sizes), sorted(bounds)
        max_width = -(-self.bounds[-1] // layout.block_size)
        self.max_seqs = min(max_num_seqs, self.sizes[-1], MAX_GRAPH_SEQS)
        self.static = StaticInputs(len(layout.groups), self.sizes[-1], self.max_seqs, max_width, storage.device)
        self.batches = {key: self.static.batch(storage, layout, *key) for key in self.keys()}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        # Runs per key: tests assert graphs ran, not merely exist.
        self.num_replays: dict[tuple[int, int], int] = {}
        self.num_static_forwards = 0  # static-buffer forwards run without a graph

    def keys(self) -> list[tuple[int, int]]:
        """(token bucket, context bound), largest first: later captures reuse its memory."""
        return [(size, bound) for size in reversed(self.sizes) for bound in reversed(self.bounds)]

    def bucket_for(self, step: V4Step) -> tuple[int, int] | None:
        """The graph key for a step, or None (run it eagerly)."""
        if step.num_seqs > self.max_seqs or (not self.mixed and step.num_tokens != step.num_seqs):
            return None
        i = bisect.bisect_left(self.sizes, step.num_tokens)
        j = bisect.bisect_left(self.bounds, step.max_seq_len)
        if i == len(self.sizes) or j == len(self.bounds):
            return None
        return self.sizes[i], self.bounds[j]

    def forward(self, key: tuple[int, int]) -> torch.Tensor:
        """The static-buffer forward of a key: hidden states [size, hidden]."""
        size = key[0]
        return self.model.forward_tokens(self.static.input_ids[:size], self.static.positions[:size], [], [],
                                         self.batches[key])

    @torch.inference_mode()
    def run(self, step: V4Step, key: tuple[int, int]) -> torch.Tensor:
        """Hidden states [T, hidden] of a step through its key's static buffers."""
        size, bound = key
        self.static.load(step, size, -(-bound // self.layout.block_size))
        if key not in self.graphs:
            self.num_static_forwards += 1
            return self.forward(key)[:step.num_tokens]
        self.graphs[key].replay()
        self.num_replays[key] = self.num_replays.get(key, 0) + 1
        return self.outputs[key][:step.num_tokens]

    @torch.inference_mode()
    def host_sync_reason(self) -> str | None:
        """Why the forward cannot be captured (it synchronises the host), or None.
        Runs the largest key's forward with synchronising CUDA calls made
        errors, after a plain run (first-call compiles and tuning may sync);
        its inputs are whatever the static buffers hold."""
        self.forward(self.keys()[0])
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self.forward(self.keys()[0])
        except RuntimeError as error:
            return str(error).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
        return None

    @torch.inference_mode()
    def capture(self, pool, keys: list[tuple[int, int]] | None = None) -> None:
        """Capture `keys` (default: all, largest first) over the buffers' current contents."""
        from kvserve.runner.cuda_graph import capture_graph
        stream = torch.cuda.Stream()
        for key in keys or self.keys():
            self.graphs[key], self.outputs[key] = capture_graph(lambda key=key: self.forward(key), pool, stream)
        torch.cuda.synchronize()
        logger.info("captured %d DeepSeek V4 CUDA graphs (%s steps of %d..%d tokens, context buckets %s)",
                    len(self.graphs), "mixed and decode" if self.mixed else "decode", self.sizes[0],
                    self.sizes[-1], self.bounds)
