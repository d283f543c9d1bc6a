"""Page copies between the GPU pool and the host pool, through one narrow, replaceable interface.

`PageCopier.to_host` / `to_device` move a set of non-contiguous pages and return a TransferHandle.
On CPU the copy is done when the call returns. On CUDA, `tiers.cuda_copy.CudaPageCopier` runs the
copies on a dedicated stream and the handle wraps an event.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tiers.device_pool import DevicePool
from tiers.host_pool import HostPool


class TransferHandle(Protocol):
    """A copy in flight: `done()` polls, `wait()` blocks the host until it completes."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class CompletedTransfer:
    """A transfer that finished before its handle was returned."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


COMPLETED = CompletedTransfer()


class PageCopier:
    """Synchronous page copies with index_select / index_copy (CPU pools, and the reference path)."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool):
        self.device_pool = device_pool
        self.host_pool = host_pool

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> TransferHandle:
        """Copy GPU pages to host pages (pairwise)."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"to_host: {len(device_pages)} device pages vs {len(host_pages)} host pages")
        if device_pages:
            self.host_pool.write_pages(host_pages, self.device_pool.read_pages(device_pages))
        return COMPLETED

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> TransferHandle:
        """Copy host pages to GPU pages (pairwise)."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"to_device: {len(host_pages)} host pages vs {len(device_pages)} device pages")
        if host_pages:
            self.device_pool.write_pages(device_pages, self.host_pool.read_pages(host_pages))
        return COMPLETED


def make_copier(device_pool: DevicePool, host_pool: HostPool) -> PageCopier:
    """The fastest copier for these pools: the CUDA stream copier on GPU, the reference one on CPU."""
    if device_pool.device.type == "cuda" and torch.cuda.is_available():
        from tiers.cuda_copy import CudaPageCopier

        return CudaPageCopier(device_pool, host_pool)
    return PageCopier(device_pool, host_pool)
