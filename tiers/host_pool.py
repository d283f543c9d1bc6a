"""The host KV pool (L2): page-first, so one page (all layers' K and V) is one contiguous block."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from tiers.base import AllocatorBacked, KVLayout, PageAllocator
from tiers.pinned import pinned_empty, shared_buffer

logger = logging.getLogger(__name__)


def available_memory_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable in /proc/meminfo), or None where
    there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostMemoryError(MemoryError):
    """The host pool asked for more memory than the machine has available."""


def _check_fits(nbytes: int) -> None:
    """Refuse a pool larger than the memory available now, with a clear error. The pool's pages are faulted in at
    once (tiers/pinned.py): past the available memory that would end in the kernel's OOM killer, not an error."""
    available = available_memory_bytes()
    if available is not None and nbytes > available:
        raise HostMemoryError(f"the host pool needs {nbytes / 2**30:.1f} GiB but only {available / 2**30:.1f} GiB "
                              "of memory is available (MemAvailable in /proc/meminfo): lower cache.host.size_gib or "
                              "cache.host.size_tokens")


class HostPool(AllocatorBacked):
    """Page-first KV storage in host memory, pinned when CUDA is available.

    `buffer` is [pages][layers][k|v][page_size][kv_heads][head_dim]; `page_view(i)` is page i as a
    contiguous 1-D uint8 tensor, the unit the L3 store reads and writes.

    `shared`: the memory is a memfd (`share_fd`) that another process can map, so that an L3 store running in
    a process of its own (tiers/l3/process.py) reads and writes the pages in place.
    """

    def __init__(self, layout: KVLayout, num_pages: int, dtype: torch.dtype, pin_memory: bool | None = None,
                 shared: bool = False):
        if num_pages <= 0:
            raise ValueError(f"host pool needs at least one page, got {num_pages}")
        self.layout = layout
        self.dtype = dtype
        self.page_bytes = layout.page_bytes
        self.capacity_pages = num_pages
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pinned = pin_memory
        shape = (num_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        nbytes = num_pages * self.page_bytes
        _check_fits(nbytes)
        self.share_fd: int | None = None
        memory = None
        if shared:
            memory, self.share_fd = shared_buffer(nbytes)
            weakref.finalize(self, os.close, self.share_fd)  # the mapping outlives the descriptor
        if pin_memory:  # faulted in by several threads, then registered at once (tiers/pinned.py)
            logger.info("pinning %.1f GiB of host memory for the host pool", nbytes / 2**30)
            self.buffer = pinned_empty(shape, dtype, shared=memory)
        elif memory is not None:
            self.buffer = memory.view(dtype).view(shape)
        else:
            self.buffer = torch.empty(shape, dtype=dtype)
        self._bytes = self.buffer.view(num_pages, -1).view(torch.uint8)
        self.allocator = PageAllocator(num_pages, "host")
        logger.info("host pool: %d pages x %d bytes, pinned=%s", num_pages, self.page_bytes, pin_memory)

    def page_view(self, page: int) -> torch.Tensor:
        """Page `page` as a contiguous 1-D uint8 tensor sharing the pool's memory."""
        return self._bytes[page]

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        return self.buffer.index_select(0, torch.as_tensor(list(pages), dtype=torch.long))

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        self.buffer.index_copy_(0, torch.as_tensor(list(pages), dtype=torch.long), data.to("cpu", self.dtype))

    def stats(self) -> dict[str, Any]:
        return {
            "capacity_pages": self.capacity_pages,
            "used_pages": self.used_pages(),
            "page_bytes": self.page_bytes,
            "pinned": self.pinned,
        }
