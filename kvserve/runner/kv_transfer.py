"""Host-tier KV storage and the executor of the KV cache's block copies.

Owns the host tensors (pinned on CUDA) and the copy stream; the slot
bookkeeping is `cache/host_tier.py`'s. A host block is stored block-major,
[group_size, 2, block_size, kv_heads, head_dim] contiguous, so a run of
consecutive slots moves in one copy. Host memory is allocated in chunks of at
most `HOST_CHUNK_BYTES` (the CUDA host allocator rounds each allocation up to
a power of two; a chunk wastes less than one block).

Ordering (CUDA): `run` makes the copy stream wait for the compute stream, so a
save reads what earlier forwards wrote; copies run on the copy stream in queue
order; the compute stream then waits on an event recorded after the last copy,
so the next forward never reads a load before it lands nor overwrites a block
before it is saved. The host is never read by the CPU. On CPU the same code
runs synchronously. Copy time is measured with events and read lazily.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvserve.cache.host_tier import BlockCopy

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


class KVTransfer:
    """Moves blocks between the GPU KV tensors and `num_host_blocks` host slots."""

    def __init__(self, kv_caches: list[torch.Tensor], num_host_blocks: int,
                 device: torch.device) -> None:
        self.kv_caches = kv_caches
        first = kv_caches[0]
        self.device = device
        self.block_shape = (len(kv_caches), 2, *first.shape[2:])
        self.block_bytes = first[:, 0].numel() * first.element_size() * len(kv_caches)
        self.blocks_per_chunk = max(1, HOST_CHUNK_BYTES // self.block_bytes)
        on_cuda = device.type == "cuda"
        self.chunks = [torch.empty((n, *self.block_shape), dtype=first.dtype, pin_memory=on_cuda)
                       for n in _chunk_sizes(num_host_blocks, self.blocks_per_chunk)]
        self.num_host_blocks = num_host_blocks
        self.stream = torch.cuda.Stream(device) if on_cuda else None
        self.stats = TransferStats()
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # ---- entry point -------------------------------------------------
    def run(self, copies: Sequence[BlockCopy]) -> None:
        """Execute `copies` in order, before anything later on the compute stream."""
        if not copies:
            return
        if self.stream is None:
            start = time.perf_counter()
            self._run_batches(copies)
            self.stats.copy_time_s += time.perf_counter() - start
        else:
            self._run_on_copy_stream(copies)
        for copy in copies:
            if copy.to_host:
                self.stats.blocks_to_host += 1
                self.stats.bytes_to_host += self.block_bytes
            else:
                self.stats.blocks_to_gpu += 1
                self.stats.bytes_to_gpu += self.block_bytes

    def _run_on_copy_stream(self, copies: Sequence[BlockCopy]) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            self._run_batches(copies)
            end.record()
        compute.wait_event(end)
        self._timings.append((start, end))
        self._harvest(wait=False)

    def _run_batches(self, copies: Sequence[BlockCopy]) -> None:
        for to_host, batch in _batches(copies):
            gpu_ids = [c.gpu_block for c in batch]
            slots = [c.host_slot for c in batch]
            if to_host:
                self._to_host(gpu_ids, slots)
            else:
                self._to_gpu(gpu_ids, slots)

    # ---- copies ------------------------------------------------------
    def _to_host(self, gpu_ids: list[int], slots: list[int]) -> None:
        index = torch.tensor(gpu_ids, dtype=torch.long, device=self.device)
        staged = torch.stack([kv.index_select(1, index) for kv in self.kv_caches])
        staged = staged.permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, G, 2, bs, H, D]
        for pos, chunk, row, length in self._runs(slots):
            chunk[row:row + length].copy_(staged[pos:pos + length], non_blocking=True)

    def _to_gpu(self, gpu_ids: list[int], slots: list[int]) -> None:
        staged = torch.empty((len(slots), *self.block_shape), dtype=self.chunks[0].dtype,
                             device=self.device)
        for pos, chunk, row, length in self._runs(slots):
            staged[pos:pos + length].copy_(chunk[row:row + length], non_blocking=True)
        index = torch.tensor(gpu_ids, dtype=torch.long, device=self.device)
        for j, kv in enumerate(self.kv_caches):
            kv.index_copy_(1, index, staged[:, j].transpose(0, 1))

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

    def measured_bytes_per_s(self) -> float | None:
        self._harvest(wait=False)
        moved = self.stats.bytes_to_host + self.stats.bytes_to_gpu
        if moved < 64 * self.block_bytes or self.stats.copy_time_s <= 0:
            return None
        return moved / self.stats.copy_time_s

    def metrics(self) -> dict[str, float]:
        self._harvest(wait=True)
        s = self.stats
        return {"kv_host_blocks_to_host": s.blocks_to_host, "kv_host_blocks_to_gpu": s.blocks_to_gpu,
                "kv_host_bytes_to_host": s.bytes_to_host, "kv_host_bytes_to_gpu": s.bytes_to_gpu,
                "kv_host_load_wait_s": s.copy_time_s}


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
