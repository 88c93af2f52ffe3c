"""Host -> device upload of a step's inputs: one copy a step, through reused buffers.

A step's inputs (token ids, positions, lengths, slot mappings, block tables:
several dtypes) are written into one pinned host buffer, each part at a
multiple of ALIGN bytes, copied to the device with one transfer, and handed
to kernels as views of the device copy. Both buffers and the views belong to
a slot of a `StagingRing` and are reused: in steady decode every step has the
same layout (the parts' dtypes and shapes), so a step builds no tensor at
all; a step whose batch changed takes the slot's layout for those shapes if
it made one before, else slices its views from the slot's layout for that
size rounded up, made once. On the H200's host, building the views each step
cost ~90 us at 256 running requests, and `torch.cuda.current_stream` ~30 us a
call (`current_stream` here looks it up by its raw handle instead). `upload` moves
one small host tensor the same way (pinned, no wait for the stream), outside the ring.
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np
import torch

ALIGN = 64   # bytes: a part's start, so views stay 16-byte aligned (Triton specializes on it)


def upload_packed(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors (any dtypes) on `device` with one transfer that does not
    wait for the stream (CUDA; on the CPU there is nothing to move). The
    returned views stay valid until the ring's slot comes round again,
    `StagingRing.SLOTS` uploads later: a step's inputs live one step."""
    if device.type != "cuda":
        return parts
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = StagingRing(device)
    return ring.upload(parts)


_RINGS: dict[torch.device, "StagingRing"] = {}   # one per device


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the stream. On CUDA a
    plain `.to(device)` (or `torch.tensor(..., device=...)`) synchronises the
    host with the stream, i.e. makes it wait for the step in flight; pinned +
    non-blocking does not. Not through a `StagingRing`: a step makes any number
    of these small uploads (per-request sampler state at admission), more than a
    fixed ring holds in flight; torch's pinned allocator keeps a block per copy."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Layout(NamedTuple):
    """A slot's buffers as one upload's parts: their host and device views."""
    key: tuple
    host_views: list[np.ndarray]
    host_bytes: torch.Tensor
    device_bytes: torch.Tensor
    device_views: list[torch.Tensor]


class StagingRing:
    """Pinned host buffers, each with its device buffer, reused in turn.

    A fresh pinned tensor a step went through torch's pinned allocator, and a size
    it had no free block for called cudaHostAlloc, which takes a driver-wide lock
    (vLLM saw it stall steps for milliseconds, vllm-project/vllm#37006; an 8K-token
    step needs sizes the steps before it never did). Here a slot's buffers grow only
    past their largest use (doubling), and the host buffer is rewritten only once the
    copy that read it has run (its event: SLOTS uploads back, long done unless that
    many steps are in flight). The device buffer needs no wait: its next copy is
    queued on the same stream, behind every kernel that read it."""

    SLOTS = 8
    MAX_LAYOUTS = 64   # layouts of each kind a slot keeps, then forgotten

    def __init__(self, device: torch.device, pin_memory: bool = True, event=None) -> None:
        self.device = device
        self.pin_memory = pin_memory
        self._event = event or torch.cuda.Event
        self._host: list[torch.Tensor | None] = [None] * self.SLOTS
        self._device: list[torch.Tensor | None] = [None] * self.SLOTS
        self._layouts: list[Layout | None] = [None] * self.SLOTS
        self._full: list[dict] = [{} for _ in range(self.SLOTS)]   # capacity layouts (`_capacity`)
        self._seen: list[dict] = [{} for _ in range(self.SLOTS)]   # layouts by their parts' shapes
        self._typed_views: list[dict] = [{} for _ in range(self.SLOTS)]
        self._events: list = [None] * self.SLOTS
        self._next = 0

    def upload(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """`parts` copied to the device in one transfer; views of the copy."""
        slot, layout = self.take(parts)
        for view, part in zip(layout.host_views, parts):
            view[...] = part.numpy()
        layout.device_bytes.copy_(layout.host_bytes, non_blocking=True)
        self.copied(slot)
        return layout.device_views

    def take(self, parts: list[torch.Tensor]) -> tuple[int, Layout]:
        """The next slot, once its last copy has run, laid out for `parts`
        (the slot's last layout when the parts' dtypes and shapes match it)."""
        slot, self._next = self._next, (self._next + 1) % self.SLOTS
        if self._events[slot] is not None:
            self._events[slot].synchronize()
        key = tuple([(t.dtype, t.shape) for t in parts])
        layout = self._layouts[slot]
        if layout is None or layout.key != key:
            layout = self._layouts[slot] = self._lay_out(slot, key, parts)
        return slot, layout

    def copied(self, slot: int) -> None:
        """The copy from `slot` is queued on the current stream: its host
        buffer may be rewritten once the event recorded there has passed."""
        if self._events[slot] is None:
            self._events[slot] = self._event()
        self._events[slot].record(current_stream(self.device) if self.device.type == "cuda" else None)

    def buffers(self, slot: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(host, device) buffers of `slot`, whole."""
        return self._host[slot], self._device[slot]

    def _lay_out(self, slot: int, key: tuple, parts: list[torch.Tensor]) -> Layout:
        """`slot`'s layout for `parts`: the one it made for their shapes before,
        else each part's first rows in the slot's capacity layout for them
        (`_capacity`), one slice a part. A server's running set changes size on
        most steps, and each new size needs new views: cut and shaped from the
        whole buffers, a decode step's cost ~62 us on this project's CPU (175 us
        on the H200's host, with one request finishing a step), against ~28 us
        for the slices and a dict lookup for a size met before."""
        layout = self._seen[slot].get(key)   # a row count the slot met before: a server's
        if layout is None:                     # running set moves within a range
            full = self._capacity(slot, parts)
            rows = [len(t) for t in parts]
            layout = Layout(key, [h[:n] for h, n in zip(full.host_views, rows)], full.host_bytes,
                            full.device_bytes, [d[:n] for d, n in zip(full.device_views, rows)])
            _remember(self._seen[slot], key, layout, self.MAX_LAYOUTS)
        return layout

    def _capacity(self, slot: int, parts: list[torch.Tensor]) -> Layout:
        """`slot`'s layout of `parts`' dtypes and trailing shapes with their rows
        rounded up to a power of two (at least 16), made once: parts of 129 to 256
        rows share one. The copy takes it whole (at most twice the bytes: a few
        KB a decode step)."""
        key = tuple([(t.dtype, max(16, 1 << (len(t) - 1).bit_length()), t.shape[1:]) for t in parts])
        layout = self._full[slot].get(key)
        if layout is None:
            layout = self._build(slot, key)
            _remember(self._full[slot], key, layout, self.MAX_LAYOUTS)
        return layout

    @torch.inference_mode(False)
    def _build(self, slot: int, key: tuple) -> Layout:
        """Views of `slot`'s buffers for parts of (dtype, rows, trailing shape)
        `key`, each at a multiple of ALIGN bytes, cut from the buffers' whole
        views of each dtype (grown first if too small). Buffers and views are
        made as normal tensors, even under inference mode (the engine's steps):
        an inference tensor's later in-place write (the next upload's copy)
        outside it would raise."""
        shapes = [(dtype, (rows, *rest)) for dtype, rows, rest in key]
        starts = _starts([dtype.itemsize * math.prod(shape) for dtype, shape in shapes])
        self._grow(slot, starts[-1])
        host_views, device_views = [], []
        for (dtype, shape), start in zip(shapes, starts):
            host_all, device_all = self._typed(slot, dtype)
            first = start // dtype.itemsize
            last = first + math.prod(shape)
            host_views.append(host_all[first:last].reshape(shape))
            device_views.append(device_all[first:last].view(shape))
        end = starts[-1]
        return Layout(key, host_views, self._host[slot][:end], self._device[slot][:end], device_views)

    def _typed(self, slot: int, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
        """`slot`'s whole buffers viewed as `dtype` (host as numpy), made once per buffer."""
        typed = self._typed_views[slot].get(dtype)
        if typed is None:
            typed = self._typed_views[slot][dtype] = (self._host[slot].view(dtype).numpy(),
                                                      self._device[slot].view(dtype))
        return typed

    def _grow(self, slot: int, nbytes: int) -> None:
        """Replace `slot`'s buffers by ones of max(nbytes, twice the size, 4 KB),
        forgetting their layouts and views, when they hold fewer than `nbytes` bytes (a
        multiple of ALIGN: every dtype views them whole)."""
        host = self._host[slot]
        if host is None or host.numel() < nbytes:
            size = max(nbytes, 2 * (0 if host is None else host.numel()), 4096)
            self._host[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            self._device[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._full[slot], self._seen[slot], self._typed_views[slot] = {}, {}, {}


def _remember(layouts: dict, key: tuple, layout: Layout, limit: int) -> None:
    """`layouts[key] = layout`, forgetting them all first at `limit` (mixed steps:
    a new token count nearly every step)."""
    if len(layouts) >= limit:
        layouts.clear()
    layouts[key] = layout


def _starts(sizes: list[int]) -> list[int]:
    """Each part's byte offset in the packed buffer (parts of `sizes` bytes), then its length."""
    return list(itertools.accumulate((-(-n // ALIGN) * ALIGN for n in sizes), initial=0))


_STREAMS: dict[int, torch.cuda.Stream] = {}   # raw CUDA stream handle -> its Stream


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """`torch.cuda.current_stream(device)`, built once per stream: that call
    makes a new Stream object each time, ~30 us on the H200's host; the raw
    handle's lookup is a C call."""
    index = device.index if device.index is not None else torch._C._cuda_getDevice()
    raw = torch._C._cuda_getCurrentRawStream(index)
    stream = _STREAMS.get(raw)
    if stream is None:
        stream = _STREAMS[raw] = torch.cuda.current_stream(index)
    return stream
