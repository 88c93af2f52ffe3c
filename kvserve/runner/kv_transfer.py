"""Host-tier KV storage and the executor of the KV cache's block copies.

Owns the host tensors (pinned on CUDA) and the copy stream; the slot
bookkeeping is `cache/host_tier.py`'s. A host block is stored block-major,
[group_size, 2, block_size, kv_heads, head_dim] contiguous, so a run of
consecutive slots moves in one copy. Host memory is allocated in chunks of at
most `HOST_CHUNK_BYTES` (the CUDA host allocator rounds each allocation up to
a power of two; a chunk wastes less than one block).

Ordering (CUDA), per `CopyBatch` (the cases are `cache/host_tier.py`'s):
  - urgent copies run on the copy stream after everything queued on the
    compute stream (so saves read what earlier forwards wrote) and after the
    fence's write-backs; the compute stream then waits for them;
  - write-backs run on the background stream after the compute stream's
    queued work and after the batch's urgent copies; an event per batch marks
    their end, and only a fence waits for it (the compute stream waits on the
    fence event itself when the batch has no urgent copy);
  - a batch fenced on itself runs in queue order on the copy stream, all of
    it waited for.
A prefetch batch (`run(batch, prefetch=True)`, the scheduler's load-ahead
admissions) is ordered the same way, except that the compute stream does not
wait for it now: `wait_prefetched()`, before the next forward, does. Issued
before this step's forward is queued, it overlaps that forward.
The host is never read by the CPU. On CPU the same code runs synchronously,
except that a prefetch is held back until the next forward (or the next
copy batch, which the copy stream would queue after it): the latest it may
land, so a forward that read it early would read stale KV in CPU tests too.
Urgent copy time (what the forward waited for) is measured with events and
read lazily, and so is the part of a prefetch the next forward still had to
wait for; write-back time is not a wait and is not counted.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvserve.cache.host_tier import BlockCopy, CopyBatch
from kvserve.runner.staging import upload

HOST_CHUNK_BYTES = 1 << 30
# Bounds the GPU staging buffer of one batch of copies.
MAX_BATCH_BLOCKS = 64


@dataclass
class TransferStats:
    blocks_to_host: int = 0
    blocks_to_gpu: int = 0
    bytes_to_host: int = 0
    bytes_to_gpu: int = 0
    copy_time_s: float = 0.0   # time the forward had to wait for copies (device time on CUDA)
    waited_bytes: int = 0      # bytes moved inside that time (write-backs are not)
    blocks_prefetched: int = 0
    prefetch_wait_s: float = 0.0  # time a forward waited for the previous step's prefetch


class KVTransfer:
    """Moves blocks between the GPU KV storage, [group_size, 2, num_blocks,
    block_size, kv_heads, head_dim] (runner/model_runner.py; DeepSeek V4's one
    page a block: [1, 1, num_blocks, unit, 1, 1]), and `num_host_blocks` host
    slots; a batch is one gather or scatter on the GPU."""

    def __init__(self, kv_storage: torch.Tensor, num_host_blocks: int,
                 device: torch.device) -> None:
        if kv_storage.dim() != 6 or kv_storage.shape[1] not in (1, 2):
            raise ValueError(f"KV storage must be [group_size, 2 (K, V) or 1 (a page), num_blocks, block_size, "
                             f"kv_heads, head_dim], got {tuple(kv_storage.shape)}")
        self.kv_storage = kv_storage
        self.device = device
        group_size, planes, _, *rest = kv_storage.shape
        self.block_shape = (group_size, planes, *rest)
        self.block_bytes = kv_storage[:, :, 0].numel() * kv_storage.element_size()
        self.blocks_per_chunk = max(1, HOST_CHUNK_BYTES // self.block_bytes)
        on_cuda = device.type == "cuda"
        self.chunks = [torch.empty((n, *self.block_shape), dtype=kv_storage.dtype, pin_memory=on_cuda)
                       for n in _chunk_sizes(num_host_blocks, self.blocks_per_chunk)]
        self.num_host_blocks = num_host_blocks
        self.stream = torch.cuda.Stream(device) if on_cuda else None
        self.background = torch.cuda.Stream(device) if on_cuda else None
        self.stats = TransferStats()
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # Write-back batch index -> event after its copies (dropped once complete).
        self._write_back_done: dict[int, torch.cuda.Event] = {}
        # The last prefetch: its end event (CUDA) or its held copies (CPU).
        self._prefetch_end: tuple[torch.cuda.Event, bool] | None = None  # (event, timed)
        self._prefetch_held: list[BlockCopy] = []
        self._prefetch_waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # ---- entry point -------------------------------------------------
    def run(self, batch: CopyBatch, prefetch: bool = False) -> None:
        """Execute a step's copies; the next forward waits for what it must, a
        prefetch only the forward after it (module doc)."""
        copies = batch.copies
        if self.stream is None:
            self._land_held_prefetch()  # the copy stream would run it first
            if prefetch:
                self._prefetch_held = list(copies)
            else:
                start = time.perf_counter()
                self._run_batches(copies)
                self.stats.copy_time_s += time.perf_counter() - start
                self.stats.waited_bytes += len(copies) * self.block_bytes
        else:
            self._run_on_copy_stream(batch, prefetch)
        if prefetch:
            self.stats.blocks_prefetched += sum(1 for c in copies if not c.to_host)
        for copy in copies:
            if copy.to_host:
                self.stats.blocks_to_host += 1
                self.stats.bytes_to_host += self.block_bytes
            else:
                self.stats.blocks_to_gpu += 1
                self.stats.bytes_to_gpu += self.block_bytes

    def wait_prefetched(self) -> None:
        """Order the next forward after the last prefetch (module doc)."""
        if self.stream is None:
            self._land_held_prefetch()
            return
        if self._prefetch_end is None:
            return
        (end, timed), self._prefetch_end = self._prefetch_end, None
        compute = torch.cuda.current_stream(self.device)
        if timed:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record(compute)
            self._prefetch_waits.append((mark, end))
        compute.wait_event(end)

    def _land_held_prefetch(self) -> None:
        held, self._prefetch_held = self._prefetch_held, []
        self._run_batches(held)

    def _run_on_copy_stream(self, batch: CopyBatch, prefetch: bool = False) -> None:
        compute = torch.cuda.current_stream(self.device)
        fence = self._fence_event(batch.fence)
        if batch.fence == batch.index:  # a write-back conflicts inside the batch
            urgent, background = batch.copies, []
        else:
            urgent = [c for c in batch.copies if not c.background]
            background = [c for c in batch.copies if c.background]
        if urgent:
            self.stream.wait_stream(compute)
            if fence is not None:
                self.stream.wait_event(fence)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                start.record()
                self._run_batches(urgent)
                end.record()
            if prefetch:
                self._prefetch_end = (end, True)
            else:
                compute.wait_event(end)
                self._timings.append((start, end))
                self.stats.waited_bytes += len(urgent) * self.block_bytes
        elif fence is not None:
            if prefetch:
                self._prefetch_end = (fence, False)
            else:
                compute.wait_event(fence)
        if background:
            self.background.wait_stream(compute)
            self.background.wait_stream(self.stream)
            with torch.cuda.stream(self.background):
                self._run_batches(background)
                done = torch.cuda.Event()
                done.record()
            self._write_back_done[batch.index] = done
        self._harvest(wait=False)

    def _fence_event(self, fence: int) -> torch.cuda.Event | None:
        """The event of the latest earlier write-back batch <= fence still in
        flight (one stream: the ones before it land first); prunes finished ones."""
        for index in [i for i, e in self._write_back_done.items() if e.query()]:
            del self._write_back_done[index]
        pending = [i for i in self._write_back_done if i <= fence]
        return self._write_back_done[max(pending)] if pending else None

    def _run_batches(self, copies: Sequence[BlockCopy]) -> None:
        for to_host, batch in _batches(copies):
            # A batch has no order among its copies, so take it in host-slot
            # order: slots are handed out as blocks are evicted, tail first, so a
            # prefix loads from descending slots and would otherwise cost one
            # host<->device copy per block (~20 us of host time each).
            batch = sorted(batch, key=lambda c: c.host_slot)
            gpu_ids = [c.gpu_block for c in batch]
            slots = [c.host_slot for c in batch]
            if to_host:
                self._to_host(gpu_ids, slots)
            else:
                self._to_gpu(gpu_ids, slots)

    # ---- copies ------------------------------------------------------
    def _index(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device without a blocking copy (a pageable source
        would synchronise the host with the copy stream, and so with the
        forward in flight)."""
        return upload(torch.tensor(ids, dtype=torch.long), self.device)

    def _to_host(self, gpu_ids: list[int], slots: list[int]) -> None:
        index = self._index(gpu_ids)
        staged = self.kv_storage.index_select(2, index)            # [G, 2, n, bs, H, D]
        staged = staged.permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, G, 2, bs, H, D]
        for pos, chunk, row, length in self._runs(slots):
            chunk[row:row + length].copy_(staged[pos:pos + length], non_blocking=True)

    def _to_gpu(self, gpu_ids: list[int], slots: list[int]) -> None:
        staged = torch.empty((len(slots), *self.block_shape), dtype=self.kv_storage.dtype,
                             device=self.device)
        for pos, chunk, row, length in self._runs(slots):
            staged[pos:pos + length].copy_(chunk[row:row + length], non_blocking=True)
        index = self._index(gpu_ids)
        self.kv_storage.index_copy_(2, index, staged.permute(1, 2, 0, 3, 4, 5))

    def _runs(self, slots: list[int]) -> Iterator[tuple[int, torch.Tensor, int, int]]:
        """(position in batch, chunk, first row, length) of consecutive-slot runs."""
        pos = 0
        while pos < len(slots):
            chunk_id, row = divmod(slots[pos], self.blocks_per_chunk)
            length = 1
            while (pos + length < len(slots) and slots[pos + length] == slots[pos] + length
                   and row + length < self.chunks[chunk_id].shape[0]):
                length += 1
            yield pos, self.chunks[chunk_id], row, length
            pos += length

    # ---- stats -------------------------------------------------------
    def _harvest(self, wait: bool) -> None:
        while self._timings and (wait or self._timings[0][1].query()):
            start, end = self._timings.pop(0)
            end.synchronize()
            self.stats.copy_time_s += start.elapsed_time(end) / 1000
        while self._prefetch_waits and (wait or all(e.query() for e in self._prefetch_waits[0])):
            mark, end = self._prefetch_waits.pop(0)
            mark.synchronize()
            end.synchronize()
            # Negative when the prefetch had landed before the forward was ready to start.
            self.stats.prefetch_wait_s += max(0.0, mark.elapsed_time(end) / 1000)

    def measured_bytes_per_s(self) -> float | None:
        """The copy rate the forward saw: bytes of the copies it waited for over
        the time it waited (write-backs, which nothing waits for, excluded)."""
        self._harvest(wait=False)
        moved = self.stats.waited_bytes
        if moved < 64 * self.block_bytes or self.stats.copy_time_s <= 0:
            return None
        return moved / self.stats.copy_time_s

    def metrics(self, wait: bool = True) -> dict[str, float]:
        """Copy counters; `wait=False` times only copies that have landed, so a
        snapshot taken while steps run never waits for the device."""
        self._harvest(wait=wait)
        s = self.stats
        return {"kv_host_blocks_to_host": s.blocks_to_host, "kv_host_blocks_to_gpu": s.blocks_to_gpu,
                "kv_host_bytes_to_host": s.bytes_to_host, "kv_host_bytes_to_gpu": s.bytes_to_gpu,
                "kv_host_blocks_prefetched": s.blocks_prefetched,
                "kv_host_load_wait_s": s.copy_time_s + s.prefetch_wait_s}


def _chunk_sizes(num_blocks: int, per_chunk: int) -> list[int]:
    full, rest = divmod(num_blocks, per_chunk)
    return [per_chunk] * full + ([rest] if rest else [])


def _batches(copies: Sequence[BlockCopy]) -> Iterator[tuple[bool, list[BlockCopy]]]:
    """Maximal same-direction runs, in order, cut so that no batch is too large
    or writes one destination twice (a batch's copies have no order among them)."""
    batch: list[BlockCopy] = []
    targets: set[int] = set()
    for copy in copies:
        target = copy.host_slot if copy.to_host else copy.gpu_block
        if batch and (copy.to_host != batch[0].to_host or target in targets
                      or len(batch) == MAX_BATCH_BLOCKS):
            yield batch[0].to_host, batch
            batch, targets = [], set()
        batch.append(copy)
        targets.add(target)
    if batch:
        yield batch[0].to_host, batch
