"""The model runner: owns the model, the KV cache tensors and the sampler,
and turns one `SchedulerOutput` into sampled tokens.

KV memory layout: the cache is one tensor [group_size, 2, num_blocks,
block_size, num_kv_heads, head_dim], seen as `group_size` contiguous views
(`kv_caches`); layer j of every KV group uses view j. One block id therefore means "these slots in group g's layers",
and blocks move freely between groups (see `cache/kv_cache_manager.py`).

With a host tier, `kv_transfer` executes the block copies a step carries
(`SchedulerOutput.kv_copies`) before that step's forward pass, and starts its
prefetch (`kv_prefetch`) so that it overlaps the forward.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from operator import attrgetter, is_
from typing import Callable

import numpy as np
import torch

from kvserve.runner.batch import ModelInputs, prepare_inputs
from kvserve.cache.host_tier import CopyBatch
from kvserve.runner.cuda_graph import DecodeGraphs
from kvserve.runner.kv_transfer import KVTransfer
from kvserve.runner.prompt_logprobs import PendingPromptLogprobs, PromptLogprobs
from kvserve.request import PENDING_TOKEN
from kvserve.runner.sampler import PendingSample, Sampler, SamplerOutput
from kvserve.runner.staging import upload
from kvserve.scheduler import ScheduledRequest, SchedulerOutput, row_request_id

logger = logging.getLogger(__name__)

# Without mixed graphs, eager steps of more tokens than this resolve the step in flight first
# (`ModelRunner.drain_above_tokens`); with them, their largest bucket is the bound. The value is
# mixed_graph.MAX_MIXED_GRAPH_TOKENS', not imported from there: that module loads Triton's kernels.
EAGER_DRAIN_TOKENS = 2048
# Layers of such a step queued before the drain (`ModelRunner.run`): an 8K-token step's layer runs
# ~5.6 ms on an H200, longer than the drain's read, bookkeeping and hand-over (~1-3 ms). Their ~35
# launches wait, as any launch does, while the step before's own long launch still fills the queue.
DRAIN_AFTER_LAYERS = 2


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    block_size: int
    group_size: int
    num_groups: int
    layer_to_slot: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return block_bytes(self.group_size, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)


def block_bytes(group_size: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> int:
    return 2 * group_size * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass
class StepResult:
    """Sampled tokens for the requests whose last known token was computed."""
    rows: list[ScheduledRequest]
    sampled: SamplerOutput


class ModelRunner:
    # Tensor parallelism: sends each step's inputs to the other ranks
    # (kvserve/distributed/launcher.py); None on one GPU.
    step_channel = None
    # CUDA events around each step's device work, read when the step resolves (`InFlightStep.gpu_ms`):
    # the step trace turns it on (engine/step_trace.py).
    time_steps = False
    # Shared-prefix decode (KVSERVE_CASCADE=1, `_cascade_wanted`); runners of other models keep it off.
    cascade = False
    decode_work = False   # work-list decode graphs (`_work_wanted`; KVSERVE_DECODE_WORK=0 turns them off)
    _cascade_last: tuple = (None, [], [])   # the planned step's sampled and scheduled rows, its groups

    def __init__(self, model: torch.nn.Module, layout: KVLayout, device: torch.device, seed: int,
                 step_channel=None) -> None:
        self.model = model
        self.step_channel = step_channel
        self.layout = layout
        self.device = device
        self.sampler = Sampler(seed, device)
        # One storage tensor, one contiguous view per layer slot: a block's KV in
        # every slot is one index along dim 2, so host-tier copies move it with one
        # gather / scatter kernel instead of one per slot.
        self.kv_storage = torch.zeros(layout.group_size, 2, layout.num_blocks, layout.block_size,
                                      layout.num_kv_heads, layout.head_dim, dtype=layout.dtype,
                                      device=device)
        self.kv_caches = list(self.kv_storage.unbind(0))
        model.bind_kv_caches([self.kv_caches[slot] for slot in layout.layer_to_slot])
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs = None  # MixedGraphs, imported with Triton on capture
        self.kv_transfer: KVTransfer | None = None
        self.num_eager_forwards = 0  # forwards not served by a graph (tests compare with replays)
        # Steps of more tokens run eagerly with every layer's kernels launched one by one (~600 for
        # a 36-layer model): the engine resolves the step in flight before launching one
        # (`LLMEngine.step`). None: never (CPU: nothing is queued).
        self.drain_above_tokens: int | None = EAGER_DRAIN_TOKENS if device.type == "cuda" else None
        self.drain_after_layers = DRAIN_AFTER_LAYERS
        self.cascade = _cascade_wanted(device, layout, step_channel)
        self.decode_work = _work_wanted(device, step_channel)

    def attach_host_tier(self, num_host_blocks: int) -> KVTransfer:
        """Host KV storage of `num_host_blocks` blocks and its copy executor."""
        self.kv_transfer = KVTransfer(self.block_major_kv(), num_host_blocks, self.device)
        logger.info("host KV tier: %d blocks (%.2f GiB)", num_host_blocks,
                    num_host_blocks * self.layout.bytes_per_block / 1024**3)
        return self.kv_transfer

    def block_major_kv(self) -> torch.Tensor:
        """The KV storage as `KVTransfer` copies it: [group_size, 2, num_blocks, ...]."""
        return self.kv_storage

    def copy_blocks(self, copies: CopyBatch, prefetch: bool = False) -> None:
        """Run a step's GPU<->host block copies; later GPU work is ordered after
        the ones it depends on (after a prefetch: from the next forward on).
        Inference mode is entered only when there is something to copy: called
        every step, mostly with nothing, its entry alone cost ~20 us."""
        if not copies:
            return
        if self.kv_transfer is None:
            raise RuntimeError("KV block copies were queued but no host tier is attached")
        with torch.inference_mode():
            self.kv_transfer.run(copies, prefetch)

    def capture_graphs(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                       mixed: bool = True) -> None:
        """CUDA graphs for decode batches and (with `mixed`, which needs the
        Triton backend's tile-table grid) for mixed steps, in one memory pool
        (CUDA only; `enforce_eager` skips this)."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        pool = torch.cuda.graph_pool_handle()
        if mixed:  # its largest step is the pool's largest graph: captured first
            from kvserve.runner.mixed_graph import MixedGraphs
            self.mixed_graphs = MixedGraphs(self.model, self.layout.num_groups, self.layout.block_size,
                                            max_model_len, max_num_seqs, max_num_batched_tokens,
                                            self.device, work=self.decode_work)
            self.mixed_graphs.capture(pool)
            self.drain_above_tokens = self.mixed_graphs.buckets[-1]
        self.graphs = DecodeGraphs(self.model, self.layout.num_groups, self.layout.block_size,
                                   max_model_len, max_num_seqs, self.device, cascade=self.cascade,
                                   work=self.decode_work)
        self.graphs.capture(pool)

    def logits_weight(self) -> torch.Tensor:
        """The [vocab, hidden] weight `compute_logits` multiplies by."""
        return self.model.lm_head.weight

    @torch.inference_mode()
    def warm_logits(self, max_rows: int) -> None:
        """Run the logits GEMM once at every row count a step can sample (1..`max_rows`).

        It runs eagerly after every forward, graph replays included, with one row per
        sampled request, and cuBLAS picks its kernel by the row count: at Qwen3-8B's
        shape on an H200, 32 of the row counts 1..300 met a kernel new to the process.
        A kernel's first launch loads it, and with the device busy (the step before still
        running, as in every pipelined step) that load held the host 76 ms on the H200's
        host (benchmarks/gemm_first_use_probe.py), against ~0.6 ms with the device idle:
        an offline scenario's first eager steps took ~200 ms of host time each, the device
        idling between them. Each batch size's first time now comes at start-up."""
        start, weight = time.perf_counter(), self.logits_weight()
        hidden = torch.zeros(max_rows, weight.shape[1], dtype=weight.dtype, device=self.device)
        for rows in range(1, max_rows + 1):
            self.model.compute_logits(hidden[:rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("logits GEMM: row counts 1..%d launched in %.2f s", max_rows, time.perf_counter() - start)

    def launch(self, out: SchedulerOutput, block_tables: list[torch.Tensor],
               previous: "InFlightStep | None" = None,
               prompt_logprobs: PromptLogprobs | None = None) -> "InFlightStep":
        """Queue one step's forward and sampling without waiting for the device:
        `prepare`, then `run`."""
        return self.run(self.prepare(out, block_tables, previous), out, prompt_logprobs)

    @torch.inference_mode()
    def prepare(self, out: SchedulerOutput, block_tables: list[torch.Tensor],
                previous: "InFlightStep | None" = None) -> ModelInputs:
        """A step's work before its forward: its block copies queued, its inputs
        built and uploaded. Tokens still pending from `previous` (sampled there,
        not yet on the host) are gathered from its device ids, so the host never
        waits for step N before preparing step N+1."""
        self.copy_blocks(out.kv_copies)  # before the forward: loads land, saves read old KV
        if self.kv_transfer is not None:
            self.kv_transfer.wait_prefetched()  # the last step's load-ahead admissions run now
        self.copy_blocks(out.kv_prefetch, prefetch=True)  # overlaps this forward
        same_rows, kept = _decode_sources(out, previous)
        inputs = prepare_inputs(out.scheduled, block_tables, self.layout.block_size, self.device, out.decode,
                                kept)
        if self.cascade and inputs.meta.is_decode_only:
            self._plan_cascade(inputs, out, previous)
        self._fill_pending(inputs, out, previous, same_rows)
        if self.step_channel is not None:
            self.step_channel.publish(inputs)
        return inputs

    @torch.inference_mode()
    def run(self, inputs: ModelInputs, out: SchedulerOutput,
            prompt_logprobs: PromptLogprobs | None = None,
            drain: Callable[[], None] | None = None) -> "InFlightStep":
        """Queue the forward and sampling of a prepared step. `prompt_logprobs`
        (empty unless a request asked) adds the prompt rows of the requests it tracks.
        `drain` (the engine's read of the step in flight) runs once the first
        `drain_after_layers` layers of an eager forward are queued, so the device goes
        on into them while the host reads and hands over the step before; a replayed
        graph runs it after its launch."""
        span = _StepSpan() if self.time_steps else None
        hidden = self._forward(inputs, drain)
        prompt = prompt_logprobs.launch(self.model, hidden, out.scheduled, inputs.host.query_start_loc) \
            if prompt_logprobs else None
        if not inputs.sampling_rows:
            return InFlightStep([], None, prompt, span and span.end())
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        params = list(map(_sampling_params, inputs.sampling_rows))
        streak_ids = _streak_ids(out)
        ids = streak_ids if streak_ids is not None else list(map(row_request_id, inputs.sampling_rows))
        sample = self.sampler.sample(logits, params, ids)
        return InFlightStep(inputs.sampling_rows, sample, prompt, span and span.end(), streak_ids)

    def execute(self, out: SchedulerOutput, block_tables: list[torch.Tensor]) -> StepResult:
        """Launch and wait: one step, unpipelined."""
        return self.launch(out, block_tables).resolve()

    def _plan_cascade(self, inputs: ModelInputs, out: SchedulerOutput, previous: "InFlightStep | None") -> None:
        """The decode step's shared-prefix groups from its host block table; an eager step gets
        its plan's tensors now, a graph rewrites its own buffers (`DecodeGraphs.run`). The same
        requests in the same order as the planned step before keep its groups: their prefix
        blocks are the same, and a prefix that ended before each member's last key still does."""
        from kvserve.attention.kernels import cascade
        table, lens = inputs.host.block_tables[0].numpy(), inputs.host.seq_lens.numpy()
        sampled, scheduled, groups = self._cascade_last
        # Members are row indices of the scheduled list: reuse needs the same list, every row a
        # decode (`out.decode`), and the step before being the planned one.
        if not (out.decode is not None and previous is not None and previous.rows is sampled
                and _same_requests(out.scheduled, scheduled)):
            groups = cascade.plan_groups(table, lens, self.layout.block_size)
        self._cascade_last = (inputs.sampling_rows, list(out.scheduled), groups)
        inputs.cascade = (groups, table)
        if self.graphs is None or not self.graphs.padded_size(inputs.meta.num_seqs):
            inputs.meta.cascade = cascade.build_plan(table, lens, self.layout.block_size, self.device, groups)

    def _fill_pending(self, inputs: ModelInputs, out: SchedulerOutput, previous: "InFlightStep | None",
                      same_rows: bool = False) -> None:
        """Tokens the step takes from `previous`'s samples, still on the device: row for row
        (`same_rows`), by the kept rows' index uploaded with the step (`_decode_sources`), or
        found one by one."""
        if same_rows:
            inputs.input_ids.copy_(previous.sample.token_ids)  # steady decode: row i is row i
            return
        if inputs.kept_rows is not None:   # the streak's rows but those that left: row i is row kept[i]
            inputs.input_ids.copy_(previous.sample.token_ids.index_select(0, inputs.kept_rows))
            return
        flat = np.flatnonzero(inputs.host.input_ids.numpy() == PENDING_TOKEN)
        if not len(flat):
            return
        if previous is None or previous.sample is None:
            raise RuntimeError("a scheduled token is pending but no step is in flight")
        if len(flat) == len(inputs.input_ids) and _same_requests(out.scheduled, previous.rows):
            inputs.input_ids.copy_(previous.sample.token_ids)  # steady decode: row i is row i
            return
        dest, index = self._pending_sources(inputs, out, previous, flat)
        # index_copy_/index_select, not `ids[dest] = tokens[index]`: torch's tensor indexing
        # costs the host ~2x as much per op.
        inputs.input_ids.index_copy_(0, dest, previous.sample.token_ids.index_select(0, index))

    def _pending_sources(self, inputs: ModelInputs, out: SchedulerOutput, previous: "InFlightStep",
                         flat: np.ndarray) -> torch.Tensor:
        """The pending tokens' places in the step (`flat`) and their rows in the
        step in flight, as one [2, n] device tensor (one upload; not a plain
        .to(device), which would wait for the step in flight: `upload`). Hot in a
        server: its running set changes on nearly every step, so a step's rows
        seldom match the step in flight's one for one. Numpy and C-level passes took
        `_fill_pending` from ~180 to ~125 us a step at 256 rows on this project's CPU
        (30 of them building `row_of`)."""
        scheduled = map(out.scheduled.__getitem__, inputs.host.seq_idx.numpy()[flat].tolist())
        pairs = np.empty((2, len(flat)), dtype=np.int64)
        pairs[0] = flat
        pairs[1] = np.fromiter(map(previous.row_of.__getitem__, map(row_request_id, scheduled)),
                               dtype=np.int64, count=len(flat))
        return upload(torch.from_numpy(pairs), self.device)

    def _forward(self, inputs: ModelInputs, drain: Callable[[], None] | None = None) -> torch.Tensor:
        hidden = self._replay(inputs)
        if hidden is not None:
            if drain is not None:
                drain()
            return hidden
        self.num_eager_forwards += 1
        if drain is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta)
        at = max(1, min(self.drain_after_layers, len(self.model.model.layers))) - 1   # exactly once
        return self.model(inputs.input_ids, inputs.positions, inputs.meta,
                          on_layer=lambda i: drain() if i == at else None)

    def _replay(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The step's output from a captured graph, or None: no graph holds it."""
        meta = inputs.meta
        if self.graphs is not None and meta.is_decode_only and self.graphs.padded_size(meta.num_seqs):
            return self.graphs.run(meta.block_tables, meta.slot_mappings,
                                   inputs.input_ids, inputs.positions, meta.seq_lens,
                                   meta.max_seq_len, inputs.cascade,
                                   inputs.host.seq_lens.numpy() if self.decode_work else None)
        if self.mixed_graphs is not None and not meta.is_decode_only:
            return self.mixed_graphs.run(inputs.input_ids, inputs.positions, meta)
        return None


def _work_wanted(device: torch.device, step_channel) -> bool:
    """On one GPU unless KVSERVE_DECODE_WORK=0 (the list is planned on this host, not published to
    tensor-parallel workers)."""
    if device.type != "cuda" or step_channel is not None:
        return False
    from kvserve.attention.kernels.decode_work import enabled_by_env
    return enabled_by_env()


def _cascade_wanted(device: torch.device, layout: KVLayout, step_channel) -> bool:
    """KVSERVE_CASCADE=1 on one GPU with one KV group (its block table is every layer's)."""
    if device.type != "cuda" or layout.num_groups != 1 or step_channel is not None:
        return False
    from kvserve.attention.kernels.cascade import enabled_by_env
    return enabled_by_env()


def _streak_ids(out: SchedulerOutput) -> list[str] | None:
    """The step's request ids when it is a steady decode step of the scheduler's
    decode streak, every row sampling: the streak keeps that one list while it
    holds, so the same list on two steps means the same requests in the same order."""
    return out.request_ids if out.decode is not None else None


def _same_rows(out: SchedulerOutput, previous: "InFlightStep") -> bool:
    """Whether `out` schedules the requests `previous` sampled, in the same
    order: O(1) within a decode streak (`_streak_ids`), else a pass over both."""
    ids = _streak_ids(out)
    if ids is not None and ids is previous.request_ids:
        return True
    return _same_requests(out.scheduled, previous.rows)


def _decode_sources(out: SchedulerOutput, previous: "InFlightStep | None") -> tuple[bool, np.ndarray | None]:
    """How a decode step whose tokens are all still on the device takes them from
    `previous`: (True, None) row for row; (False, index) by each row's row there, an
    index that travels with the step's upload (`prepare_inputs`: a separate upload cost
    the H200's host a pinned copy a step); (False, None) neither applies."""
    if out.decode is None or not out.decode.on_device or previous is None or previous.sample is None:
        return False, None
    if _same_rows(out, previous):
        return True, None
    return False, _kept_rows(out, previous)


def _kept_rows(out: SchedulerOutput, previous: "InFlightStep") -> np.ndarray | None:
    """Each row's row in `previous`, when the decode streak gave `out` the rows of
    `previous` that stay (`SchedulerOutput.previous_rows`); else None."""
    source = out.previous_rows
    if source is None or source[0] is not previous.request_ids:   # set only with out.request_ids
        return None
    return source[1]


def _same_requests(scheduled: list[ScheduledRequest], previous: list[ScheduledRequest]) -> bool:
    """Whether both lists hold the same requests in the same order."""
    return len(scheduled) == len(previous) and all(map(is_, map(_request, scheduled), map(_request, previous)))


# Row getters for C-level passes over a step's rows (`map`: no Python frame per row).
_request = attrgetter("request")
_sampling_params = attrgetter("request.sampling_params")


class _StepSpan:
    """Two CUDA events around a step's device work: recorded when its launch starts and ends, so
    their elapsed time is the device's time on the step from its first kernel to its last (idle
    before it, waiting for the step before, is not in it)."""

    def __init__(self) -> None:
        self.start, self.stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.start.record()

    def end(self) -> "_StepSpan":
        self.stop.record()
        return self

    def ms(self) -> float:
        self.stop.synchronize()   # recorded after the step's output copy began: done, or nearly
        return self.start.elapsed_time(self.stop)


class InFlightStep:
    """A launched step: which requests sample, their pending sample, the
    pending prompt logprobs (None unless a request asked) and, when the runner
    times steps, its device span."""

    def __init__(self, rows: list[ScheduledRequest], sample: PendingSample | None,
                 prompt: PendingPromptLogprobs | None = None, span: _StepSpan | None = None,
                 request_ids: list[str] | None = None) -> None:
        self.rows = rows
        # The rows' ids when the step was a decode streak's (`_streak_ids`), else None.
        self.request_ids = request_ids
        self.sample = sample
        self.prompt = prompt
        self.span = span
        self._row_of: dict[str, int] | None = None

    def gpu_ms(self) -> float:
        """The step's device span in ms (call after `resolve`); NaN when not timed."""
        return self.span.ms() if self.span is not None else float("nan")

    @property
    def row_of(self) -> dict[str, int]:
        """Request id -> sample row; built on first use (only a step whose
        tokens are pending reads it)."""
        if self._row_of is None:
            self._row_of = dict(zip(map(row_request_id, self.rows), range(len(self.rows))))
        return self._row_of

    def resolve(self) -> StepResult:
        """Wait for this step's sampled ids on the host (prompt logprobs go
        straight into their requests)."""
        if self.prompt is not None:
            self.prompt.resolve()
        if self.sample is None:
            return StepResult([], SamplerOutput([], [], []))
        return StepResult(self.rows, self.sample.resolve())
