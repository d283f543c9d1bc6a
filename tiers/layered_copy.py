"""Host -> GPU loads issued layer by layer, so that a forward waits for each layer's KV just before that layer.

A whole-prefix load makes the forward wait for every layer of the prefix before its first layer starts: the GPU
hit's time plus the load's. Issued layer group by layer group, with an event after each group lands, the load
of layer i+1 runs on the copy engines while the GPU computes layer i, and the forward waits (on the GPU, never
on the host) for layer i's event before layer i (`LayeredTransfer.stream_wait_layer`; the engine's model calls it).

The host pool is page-first ([pages][layers][k|v][...]), so one layer of a page is a slice `page_bytes /
layers` long at a stride of `page_bytes`. Two ways to move it:
- "dma": one `cudaMemcpy2DAsync` per run of consecutive host pages and layer group (CuPy's binding) copies
  the strided slices into a GPU staging buffer on the copy engines, and a second stream scatters the staged
  pages into the layer-first pool. Runs are as long as the host pages are consecutive; a host pool fragmented
  into short runs gets wider layer groups, so that the copy calls stay few (MAX_COPY_CALLS).
- "zero_copy" (small pages): a gather kernel reads the group's slices of the mapped host pool over PCIe.

A load whose issuing fails part-way (a copy call refused) is marked `failed`: the layers after the failure
were never queued, so the controller drops its pages and the request recomputes them. Nothing waits on it.

The loads run at the copier's whole-load rate, and what a host hit then costs against a GPU hit is in
bench/RESULTS.md, 'A host hit against a GPU hit'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiers.cuda_copy import CudaTransfer, _runs, keep, wait_for_compute

logger = logging.getLogger(__name__)

# per load, at most about this many cudaMemcpy2DAsync calls (each costs the engine thread a few microseconds):
# a host pool fragmented into single-page runs gets layer groups wide enough to stay under it
MAX_COPY_CALLS = 2048


def memcpy_2d() -> Any:
    """CuPy's `cudaMemcpy2DAsync` binding, or None without CuPy (the copier then loads whole prefixes)."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return None
    return runtime


class LayeredTransfer(CudaTransfer):
    """A host -> GPU copy issued layer group by layer group: `layer_events[i]` is recorded once layer i of every
    page is in the pool, `event` once all of it is (or, `failed`, once what was queued has landed)."""

    streams = True  # a forward may start before it lands, waiting for each layer (see the module doc)

    def __init__(self, layer_events: list[torch.cuda.Event], event: torch.cuda.Event, failed: bool):
        super().__init__(event)
        self.layer_events = layer_events
        self.failed = failed

    def stream_wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` wait for layer `layer` of every page. A failed load has no event for the layers it never
        queued (and a wait on an unrecorded event would not wait): refused."""
        if self.failed:
            raise RuntimeError("a forward waited on a host -> GPU load that failed: its request must recompute")
        (stream or torch.cuda.current_stream()).wait_event(self.layer_events[layer])


def layer_waits(handles: Sequence[Any]) -> Callable[[int], None] | None:
    """What a forward does about the loads it reads: the current stream waits now for every copy that is not
    layered (on the GPU; a finished or CPU copy has nothing to wait for), and the returned hook, called with
    a layer's index just before that layer runs, waits for that layer of the layered ones (None: nothing to
    wait for per layer). Models take it as `before_layer`."""
    layered = []
    for h in handles:
        if getattr(h, "streams", False):
            layered.append(h)
        elif (wait := getattr(h, "stream_wait", None)) is not None:
            wait()
    if not layered:
        return None

    def before_layer(layer: int) -> None:
        for h in layered:
            h.stream_wait_layer(layer)

    return before_layer


class LayerLoader:
    """Issues layered loads for a `tiers.cuda_copy.CudaPageCopier`, on streams and staging buffers of its own: on the
    copier's, a load queued behind the backups (GPU -> host copies, gathers into the shared staging) that a burst of
    new pages had just started, and a host hit waited for another request's write-through."""

    def __init__(self, copier: Any, runtime: Any, staging_bytes: int):
        self.copier = copier
        self.runtime = runtime  # CuPy's runtime (dma), or None (zero_copy: the copier's mapped host pool)
        layout = copier.device_pool.layout
        self.num_layers: int = layout.num_layers
        self.layer_bytes: int = layout.page_bytes // layout.num_layers
        self.page_bytes: int = layout.page_bytes
        self.fail_at_layer: int | None = None  # tests: issuing this layer raises (a copy call refused)
        device = copier.device_pool.device
        self.copy_stream = torch.cuda.Stream(device)  # host -> staging copies (zero_copy: the gathers)
        self.shuffle_stream = torch.cuda.Stream(device)  # staging -> pool scatters
        elements = max(1, staging_bytes // copier.device_pool.kv.element_size())
        self.staging = ([torch.empty(elements, dtype=copier.device_pool.dtype, device=device) for _ in range(2)]
                        if runtime is not None else [])
        self.staging_free = [torch.cuda.Event() for _ in self.staging]
        for ev in self.staging_free:
            ev.record(self.shuffle_stream)
        self._turn = 0  # the staging buffer used last

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int], after: object) -> LayeredTransfer:
        """Queue the copy of host pages into GPU pages (pairwise), layer group by layer group. Like the copier's, it
        waits for the compute queued before it, or only before `after` (a fence)."""
        c = self.copier
        streams = (self.copy_stream, self.shuffle_stream)
        wait_for_compute(streams, after)
        dev_index = c._index(device_pages, self.copy_stream)
        host_index = c._index(host_pages, self.copy_stream) if c.host_alias is not None else None
        keep(streams, dev_index, host_index)
        runs = _runs(host_pages, max(1, len(host_pages)))
        group = self.group_layers(len(runs))
        events: list[torch.cuda.Event] = []
        failed = False
        last = self.copy_stream if c.host_alias is not None else self.shuffle_stream  # where each group ends
        # dma: the chunks and their host page runs are the same for every layer group (the widest group's chunk)
        chunks = self._chunks(host_pages, group) if c.host_alias is None else []
        try:
            with torch.cuda.stream(self.shuffle_stream):  # the scatters' stream (the copies name theirs)
                for first in range(0, self.num_layers, group):
                    end = min(self.num_layers, first + group)
                    if self.fail_at_layer is not None and first <= self.fail_at_layer < end:
                        raise RuntimeError(f"injected failure issuing layer {self.fail_at_layer}")
                    if c.host_alias is not None:
                        self._gather_layers(host_index, dev_index, first, end)
                    else:
                        self._dma_layers(chunks, dev_index, first, end)
                    landed = torch.cuda.Event()
                    landed.record(last)
                    events.extend([landed] * (end - first))
        except Exception:  # noqa: BLE001 - the layers queued so far land; the load is failed, its pages recomputed
            logger.exception("a layered host -> GPU load of %d pages failed at layer %d of %d", len(host_pages),
                             len(events), self.num_layers)
            failed = True
        done = torch.cuda.Event()
        done.record(last)
        return LayeredTransfer(events, done, failed)

    def group_layers(self, runs: int) -> int:
        """Layers per group: 1, or wider where a fragmented host pool would take more than MAX_COPY_CALLS calls
        (zero_copy: one kernel per group whatever the runs, so always 1)."""
        if self.copier.host_alias is not None:
            return 1
        return max(1, min(self.num_layers, -(-runs * self.num_layers // MAX_COPY_CALLS)))

    def _gather_layers(self, host_index: torch.Tensor | None, dev_index: torch.Tensor, first: int, end: int) -> None:
        c = self.copier
        assert host_index is not None and c.host_alias is not None
        with torch.cuda.stream(self.copy_stream):
            pages = c.host_alias[:, first:end].index_select(0, host_index)  # reads host memory over PCIe
            c.device_pool.kv[first:end].index_copy_(2, dev_index, pages.permute(1, 2, 0, 3, 4, 5))

    def _chunks(self, host_pages: Sequence[int], group: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """The load cut into (start, stop, runs of consecutive host pages) pieces that one staging buffer holds
        for a group of `group` layers: computed once per load, not once per layer group (a long prefix's runs
        cost the engine thread a Python pass over its pages each time)."""
        width = group * self.layer_bytes
        chunk = max(1, self.staging[0].numel() * self.staging[0].element_size() // width)
        return [(start, min(len(host_pages), start + chunk), _runs(host_pages[start : start + chunk], chunk))
                for start in range(0, len(host_pages), chunk)]

    def _dma_layers(self, chunks: list[tuple[int, int, list[tuple[int, int, int]]]], dev_index: torch.Tensor,
                    first: int, end: int) -> None:
        """Layers [first, end) of every page: strided copies into staging (copy stream), scatters into the pool
        (the shuffle stream: the caller's current stream), chunk by chunk through the double-buffered staging
        buffers. Streams are named, not entered, per chunk: a long prefix's load issues thousands of these."""
        c = self.copier
        width = (end - first) * self.layer_bytes  # one page's bytes of these layers
        host_base = c.host_pool.buffer.data_ptr() + first * self.layer_bytes
        kv = c.device_pool.kv[first:end]
        shape = (end - first, 2, *kv.shape[3:])
        copy_stream, shuffle_stream = self.copy_stream, self.shuffle_stream
        handle, page_bytes, to_device = copy_stream.cuda_stream, self.page_bytes, self.runtime.memcpyHostToDevice
        memcpy_2d = self.runtime.memcpy2DAsync
        for start, stop, runs in chunks:
            buf = self._turn = (self._turn + 1) % 2
            staging = self.staging[buf]
            copy_stream.wait_event(self.staging_free[buf])
            base = staging.data_ptr()
            for offset, page, length in runs:
                memcpy_2d(base + offset * width, width, host_base + page * page_bytes, page_bytes, width, length,
                          to_device, handle)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
            shuffle_stream.wait_event(copied)
            staged = staging[: (stop - start) * width // kv.element_size()]
            kv.index_copy_(2, dev_index[start:stop], staged.view(stop - start, *shape).permute(1, 2, 0, 3, 4, 5))
            self.staging_free[buf].record(shuffle_stream)
