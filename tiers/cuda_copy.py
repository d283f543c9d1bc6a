"""Page copies between the layer-first GPU pool and the page-first pinned host pool on CUDA streams.

Two ways to move a batch of non-contiguous pages, chosen by page size:
- "dma" (large pages): whole host pages (contiguous, page-first) are copied by the copy engines
  into a GPU staging buffer, runs of consecutive host pages as one copy; a second stream scatters
  each staged chunk into the layer-first pool. Demotion is the mirror: gather into staging, then
  copy out. Chunks are double-buffered so the GPU-side gather/scatter of one chunk overlaps the
  PCIe copy of the next; streams are ordered with events, never with host synchronisation.
- "zero_copy" (small pages, where one copy per page would be dominated by launch overhead): the
  pinned host pool is mapped into the GPU's address space (unified addressing) and one gather /
  scatter kernel reads or writes host memory over PCIe directly. Needs CuPy to wrap the mapped
  pointer as a CUDA tensor; without it the "dma" path is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tiers.device_pool import DevicePool
from tiers.host_pool import HostPool
from tiers.pinned import map_host_tensor

if TYPE_CHECKING:  # tiers.layered_copy builds on this module's transfers and stream helpers
    from tiers.layered_copy import LayeredTransfer

# per staging buffer; two of them (256 MiB measured no faster: bench/RESULTS.md, 'Host <-> GPU page transfers')
STAGING_BYTES = 64 << 20
FENCE_EVENTS = 4  # fence() events, reused in turn
ZERO_COPY_MAX_PAGE_BYTES = 1 << 20  # below this page size the mapped-memory kernels win (bench/transfer_bench.py)


class CudaTransfer:
    """A transfer in flight on CUDA streams, finished when `event` completes."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()

    def stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for this transfer without blocking the host."""
        (stream or torch.cuda.current_stream()).wait_event(self.event)


def wait_for_compute(streams: Sequence[torch.cuda.Stream], after: object) -> None:
    """Order `streams` after the compute queued so far, or only after `after` (a `fence()`: an event)."""
    for stream in streams:
        if after is None:
            stream.wait_stream(torch.cuda.current_stream())
        else:
            assert isinstance(after, torch.cuda.Event)
            stream.wait_event(after)


def keep(streams: Sequence[torch.cuda.Stream], *tensors: torch.Tensor | None) -> None:
    """Tell the caching allocator these tensors (allocated on one of `streams`) are in use on all of them."""
    for t in tensors:
        if t is not None:
            for stream in streams:
                t.record_stream(stream)


def _runs(pages: Sequence[int], limit: int) -> list[tuple[int, int, int]]:
    """Split `pages` into (start index, first page, length) runs of consecutive page ids, <= limit long."""
    runs = []
    i, n = 0, len(pages)
    while i < n:
        j = i + 1
        while j < n and j - i < limit and pages[j] == pages[j - 1] + 1:
            j += 1
        runs.append((i, pages[i], j - i))
        i = j
    return runs


class CudaPageCopier:
    """Double-buffered, two-stream page copier; see the module docstring."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, staging_bytes: int = STAGING_BYTES,
                 mode: str = "auto", layered: bool = True):
        """layered: loads are issued layer by layer, and a forward may start before they land
        (tiers/layered_copy.py); needs CuPy (without it every load is whole, and waited for whole)."""
        if not host_pool.pinned:
            raise ValueError("CudaPageCopier needs a pinned host pool")
        if mode not in ("auto", "dma", "zero_copy"):
            raise ValueError(f"copier mode {mode!r}; choices: auto, dma, zero_copy")
        self.device_pool = device_pool
        self.host_pool = host_pool
        layout = device_pool.layout
        self.host_alias = None
        if mode == "zero_copy" or (mode == "auto" and layout.page_bytes < ZERO_COPY_MAX_PAGE_BYTES):
            self.host_alias = map_host_tensor(host_pool.buffer, device_pool.device)
            if self.host_alias is None and mode == "zero_copy":
                raise RuntimeError("zero_copy copier: cannot map the host pool into GPU memory (needs CuPy)")
        self.mode = "zero_copy" if self.host_alias is not None else "dma"
        self.chunk_pages = max(1, staging_bytes // layout.page_bytes)
        shape = (self.chunk_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        device = device_pool.device
        self.staging = [torch.empty(shape, dtype=device_pool.dtype, device=device) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device)
        self.shuffle_stream = torch.cuda.Stream(device)  # GPU-side gather/scatter
        self.staging_free = [torch.cuda.Event() for _ in range(2)]
        self._fences = [torch.cuda.Event() for _ in range(FENCE_EVENTS)]  # see fence()
        self._next_fence = 0
        for ev in self.staging_free:
            ev.record(self.shuffle_stream)
        from tiers.layered_copy import LayerLoader, memcpy_2d

        runtime = memcpy_2d() if layered and self.host_alias is None else None
        self.layers = (LayerLoader(self, runtime, staging_bytes) if layered and (self.host_alias is not None or runtime)
                       else None)

    def _keep(self, *tensors: torch.Tensor | None) -> None:
        keep((self.copy_stream, self.shuffle_stream), *tensors)

    def _index(self, pages: Sequence[int], stream: torch.cuda.Stream) -> torch.Tensor:
        """Page ids on the device, uploaded on `stream` (a copier stream). On the compute stream the upload
        would queue in the copy engine behind every load in flight, and the next forward behind it."""
        with torch.cuda.stream(stream):
            index = torch.as_tensor(list(pages), dtype=torch.long).pin_memory()
            return index.to(self.device_pool.device, non_blocking=True)

    def _wait_for_compute(self, after: object) -> None:
        wait_for_compute((self.copy_stream, self.shuffle_stream), after)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return [(s, min(n, s + self.chunk_pages)) for s in range(0, n, self.chunk_pages)]

    def fence(self) -> torch.cuda.Event:
        """An event after the compute work queued so far, for a `to_device` started later (`after`).

        The engine fences before every forward, so the events are reused, FENCE_EVENTS in turn, rather than created
        and destroyed a step. A stream that waits on a fence uses its latest recording: a fence re-recorded before
        a copy waited on it makes that copy wait for more compute, never for less. LaunchLater starts its held
        copies before the next fence is taken."""
        event = self._fences[self._next_fence]
        self._next_fence = (self._next_fence + 1) % FENCE_EVENTS
        event.record(torch.cuda.current_stream())
        return event

    def to_device(
        self, host_pages: Sequence[int], device_pages: Sequence[int], after: object = None
    ) -> CudaTransfer | LayeredTransfer:
        """Promote host pages into GPU pages; returns when the copies are queued (layer by layer where `layers`).

        The copies wait for the compute work queued before them (pages being overwritten may still be read by it),
        or, given `after` (a `fence()`), only for the work queued before that fence."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"to_device: {len(host_pages)} host pages vs {len(device_pages)} device pages")
        if self.layers is not None and host_pages:
            return self.layers.load(host_pages, device_pages, after)
        kv, host = self.device_pool.kv, self.host_pool.buffer
        self._wait_for_compute(after)
        dev_index = self._index(device_pages, self.copy_stream)  # the scatter waits for the copy stream's events
        host_index = self._index(host_pages, self.copy_stream) if self.host_alias is not None else None
        self._keep(dev_index, host_index)
        if self.host_alias is not None:
            with torch.cuda.stream(self.copy_stream):
                assert host_index is not None
                pages = self.host_alias.index_select(0, host_index)  # kernel reads host memory over PCIe
                kv.index_copy_(2, dev_index, pages.permute(1, 2, 0, 3, 4, 5))
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            return CudaTransfer(done)
        for k, (start, end) in enumerate(self._chunks(len(host_pages))):
            buf = k % 2
            staging = self.staging[buf]
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.staging_free[buf])
                for offset, first, length in _runs(host_pages[start:end], self.chunk_pages):
                    staging[offset : offset + length].copy_(host[first : first + length], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.copy_stream)
            with torch.cuda.stream(self.shuffle_stream):
                self.shuffle_stream.wait_event(copied)
                kv.index_copy_(2, dev_index[start:end], staging[: end - start].permute(1, 2, 0, 3, 4, 5))
                self.staging_free[buf].record(self.shuffle_stream)
        done = torch.cuda.Event()
        done.record(self.shuffle_stream)
        return CudaTransfer(done)

    def to_host(
        self, device_pages: Sequence[int], host_pages: Sequence[int], after: object = None
    ) -> CudaTransfer:
        """Demote GPU pages into host pages; returns when the copies are queued.

        The copies wait for the compute work queued before them (it wrote the KV being saved), or, given `after`
        (a `fence()`), only for the work queued before that fence: the caller knows the pages were written by then."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"to_host: {len(device_pages)} device pages vs {len(host_pages)} host pages")
        kv, host = self.device_pool.kv, self.host_pool.buffer
        self._wait_for_compute(after)
        gather = self.copy_stream if self.host_alias is not None else self.shuffle_stream  # the stream that gathers
        dev_index = self._index(device_pages, gather)
        host_index = self._index(host_pages, gather) if self.host_alias is not None else None
        self._keep(dev_index, host_index)
        if self.host_alias is not None:
            with torch.cuda.stream(self.copy_stream):
                pages = kv.index_select(2, dev_index).permute(2, 0, 1, 3, 4, 5)
                assert host_index is not None
                self.host_alias.index_copy_(0, host_index, pages)  # kernel writes host memory over PCIe
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            return CudaTransfer(done)
        for k, (start, end) in enumerate(self._chunks(len(device_pages))):
            buf = k % 2
            staging = self.staging[buf]
            with torch.cuda.stream(self.shuffle_stream):
                self.shuffle_stream.wait_event(self.staging_free[buf])
                staging[: end - start].copy_(kv.index_select(2, dev_index[start:end]).permute(2, 0, 1, 3, 4, 5))
                gathered = torch.cuda.Event()
                gathered.record(self.shuffle_stream)
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(gathered)
                for offset, first, length in _runs(host_pages[start:end], self.chunk_pages):
                    host[first : first + length].copy_(staging[offset : offset + length], non_blocking=True)
                self.staging_free[buf].record(self.copy_stream)
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        return CudaTransfer(done)
