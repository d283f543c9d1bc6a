"""Startup measurements for the cost model: host -> GPU copy bandwidth and L3 -> GPU read bandwidth.

Each measurement moves real pages through the same paths serving uses (the copier; the L3 store
and then the copier), on scratch pages it allocates and frees, so it costs a few milliseconds on
a GPU and a few pages of disk I/O. The L3 probe writes scratch pages under random keys and deletes
them again.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)


def _sync(copier: Any) -> None:
    import torch

    if getattr(copier, "device_pool", None) is not None and copier.device_pool.device.type == "cuda":
        torch.cuda.synchronize(copier.device_pool.device)


def host_to_device_bandwidth(copier: Any, device: Any, host: Any, pages: int = 16) -> float | None:
    """Bytes/s of copier.to_device for `pages` scattered pages (best of 3); None if the pools are too small."""
    pages = min(pages, device.allocator.free_pages // 2, host.allocator.free_pages)
    if pages < 1:
        return None
    allocated = device.allocate(2 * pages)
    dev_pages = allocated[::2]  # every other page: non-contiguous, as in serving
    host_pages = host.allocate(pages)
    try:
        copier.to_device(host_pages, dev_pages).wait()  # warm-up
        best = float("inf")
        for _ in range(3):
            _sync(copier)
            start = time.perf_counter()
            copier.to_device(host_pages, dev_pages).wait()
            best = min(best, time.perf_counter() - start)
        return float(pages * host.page_bytes / best)
    finally:
        device.free(allocated)
        host.free(host_pages)


CALIBRATION_IO_S = 1.0  # about how long the L3 bandwidth calibration writes (and each of its reads takes)


def disk_to_device_bandwidth(l3: Any, copier: Any, device: Any, host: Any, pages: int = 32,
                             max_bytes: int = 256 << 20) -> float | None:
    """Bytes/s of reading pages from L3 into host pages and copying them to the GPU: at most `pages` pages and
    `max_bytes`, best of 3 reads (the first also starts the store's I/O threads). One batch, as a request's
    load reads; the estimate then follows the reads serving makes (Loads._observe_disk_read). A first page's
    write, timed, sizes the batch to about CALIBRATION_IO_S of writing, so that a slow or capped store
    (cache.l3.write_limit_gbps) is measured in seconds rather than minutes."""
    pages = min(pages, max(1, max_bytes // max(1, host.page_bytes)), host.allocator.free_pages,
                device.allocator.free_pages)
    if pages < 1 or l3.capacity_pages - l3.used_pages() < pages:
        return None
    host_pages = host.allocate(pages)
    dev_pages = device.allocate(pages)
    keys = [os.urandom(16) for _ in range(pages)]
    views = [host.page_view(p) for p in host_pages]
    try:
        start = time.perf_counter()
        if not all(l3.write_pages(keys[:1], views[:1])):
            return None
        one = time.perf_counter() - start
        if one * pages > CALIBRATION_IO_S:  # a slow store: as many pages as about CALIBRATION_IO_S writes
            keep = max(1, int(CALIBRATION_IO_S / one))
            host.free(host_pages[keep:])
            device.free(dev_pages[keep:])
            keys, views, host_pages, dev_pages, pages = keys[:keep], views[:keep], host_pages[:keep], \
                dev_pages[:keep], keep
        if pages > 1 and not all(l3.write_pages(keys[1:], views[1:])):
            return None
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            ok = l3.read_pages(keys, views)
            if copier is not None:
                copier.to_device(host_pages, dev_pages).wait()
            if not all(ok):
                return None
            best = min(best, time.perf_counter() - start)
        return float(pages * host.page_bytes / best)
    finally:
        l3.discard(keys)  # everywhere: a remote tier keeps what is only deleted here
        host.free(host_pages)
        device.free(dev_pages)
