"""Page copies between the GPU pool and the host pool, through one narrow, replaceable interface.

`PageCopier.to_host` / `to_device` move a set of non-contiguous pages and return a TransferHandle.
On CPU the copy is done when the call returns. On CUDA, `tiers.cuda_copy.CudaPageCopier` runs the
copies on a dedicated stream and the handle wraps an event. `LaunchLater` wraps either: it queues loads
and starts them when told to, once the engine has queued its forward step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the pools (and torch) load only where a copier is made
    from tiers.device_pool import DevicePool
    from tiers.host_pool import HostPool


class TransferHandle(Protocol):
    """A copy in flight: `done()` polls, `wait()` blocks the host until it completes."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class FencedCopier(Protocol):
    """A page copier whose copies can wait for a fence of the compute queued earlier (`after`): `PageCopier` on the
    CPU, `tiers.cuda_copy.CudaPageCopier` on CUDA streams."""

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int],
                after: object = None) -> TransferHandle: ...

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int],
                  after: object = None) -> TransferHandle: ...

    def fence(self) -> object: ...


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

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int], after: object = None) -> TransferHandle:
        """Copy GPU pages to host pages (pairwise). `after`: as for `to_device`."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"to_host: {len(device_pages)} device pages vs {len(host_pages)} host pages")
        if device_pages:
            self.host_pool.write_pages(host_pages, self.device_pool.read_pages(device_pages))
        return COMPLETED

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int],
                  after: object = None) -> TransferHandle:
        """Copy host pages to GPU pages (pairwise). `after` (a `fence()`) is for the CUDA copier; here there is
        nothing in flight to wait for."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"to_device: {len(host_pages)} host pages vs {len(device_pages)} device pages")
        if host_pages:
            self.device_pool.write_pages(device_pages, self.host_pool.read_pages(host_pages))
        return COMPLETED

    def fence(self) -> object:
        """A mark of the compute work queued so far (`CudaPageCopier.fence`); nothing is queued on CPU."""
        return None


class HeldTransfer:
    """A load that `LaunchLater` queued: not done before it is launched; waiting on it launches it."""

    def __init__(self, owner: LaunchLater, host_pages: list[int], device_pages: list[int], fence: object):
        self.owner = owner
        self.host_pages = host_pages
        self.device_pages = device_pages
        self.fence = fence
        self.transfer: TransferHandle | None = None

    def done(self) -> bool:
        return self.transfer is not None and self.transfer.done()

    def wait(self) -> None:
        if self.transfer is None:
            self.owner.launch()
        assert self.transfer is not None  # launch() starts every held load
        self.transfer.wait()

    def stream_wait(self, stream: object = None) -> None:
        """Make `stream` wait for the copy (CUDA), launching it first if it is still held."""
        if self.transfer is None:
            self.owner.launch()
        wait = getattr(self.transfer, "stream_wait", None)
        if wait is not None:
            wait(stream)

    @property
    def streams(self) -> bool:
        """Launched, layer by layer (tiers/layered_copy.py): a forward may start now and wait for each layer."""
        return self.transfer is not None and getattr(self.transfer, "streams", False)

    @property
    def failed(self) -> bool:
        """Launched, and its issuing failed part-way (tiers/layered_copy.py)."""
        return self.transfer is not None and getattr(self.transfer, "failed", False)

    def stream_wait_layer(self, layer: int, stream: object = None) -> None:
        """Make `stream` wait for one layer of the launched, layered copy."""
        assert self.transfer is not None, "a forward waits per layer only on a launched load"
        self.transfer.stream_wait_layer(layer, stream)  # type: ignore[attr-defined]


class LaunchLater:
    """A copier whose loads (`to_device`) start at the next `launch()` rather than when they are asked for.

    The engine asks for loads while it schedules a step, when the GPU has nothing queued, and calls `launch()`
    once the step's forward is queued: the CPU time of starting the copies then overlaps the GPU's work instead of
    delaying it. Each held load keeps a `fence()` of the compute work queued when it was asked for and waits for
    that, not for the forward queued since (which does not touch its pages: they belong to requests still
    loading). Backups (`to_host`) pass straight through: L3 writer threads wait on their handles.

    `pin_fence()`, called just before a forward is queued, lets the engine schedule the next step while that
    forward runs (`scheduler.admit_during_forward`): until the next `launch()`, loads and backups wait only for the
    compute queued before the pin. That is safe because the forward in flight reads and writes only pages of the
    requests it runs, which nothing admitted meanwhile can evict or overwrite, and backups save pages committed
    by earlier steps. Engine thread only.
    """

    def __init__(self, copier: FencedCopier):
        self.copier = copier
        self._held: list[HeldTransfer] = []
        self._pinned: object = None  # pin_fence()'s fence, until launch()
        self.launches = 0  # launch() calls that started at least one load
        self.launched_loads = 0

    def __getattr__(self, name: str) -> object:  # mode, staging, pools: the wrapped copier's
        return getattr(self.copier, name)

    @property
    def held(self) -> int:
        return len(self._held)

    def pin_fence(self) -> None:
        """Fence the compute queued so far; loads and backups asked for before the next `launch()` wait only for
        that (see the class doc)."""
        self._pinned = self.copier.fence()

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> TransferHandle:
        if self._pinned is not None:
            return self.copier.to_host(device_pages, host_pages, after=self._pinned)
        return self.copier.to_host(device_pages, host_pages)

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> HeldTransfer:
        if len(device_pages) != len(host_pages):
            raise ValueError(f"to_device: {len(host_pages)} host pages vs {len(device_pages)} device pages")
        fence = self._pinned if self._pinned is not None else self.copier.fence()
        held = HeldTransfer(self, list(host_pages), list(device_pages), fence)
        self._held.append(held)
        return held

    def launch(self) -> int:
        """Start every held load, in the order they were asked for, and drop the pinned fence; returns how many."""
        held, self._held = self._held, []
        self._pinned = None
        for h in held:
            h.transfer = self.copier.to_device(h.host_pages, h.device_pages, after=h.fence)
        if held:
            self.launches += 1
            self.launched_loads += len(held)
        return len(held)


def make_copier(device_pool: DevicePool, host_pool: HostPool, layered: bool = True) -> FencedCopier:
    """The fastest copier for these pools: the CUDA stream copier on GPU (loading layer by layer where `layered`:
    tiers/layered_copy.py), the reference one on CPU."""
    import torch

    if device_pool.device.type == "cuda" and torch.cuda.is_available():
        from tiers.cuda_copy import CudaPageCopier

        return CudaPageCopier(device_pool, host_pool, layered=layered)
    return PageCopier(device_pool, host_pool)
