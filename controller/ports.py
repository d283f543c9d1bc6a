"""What the controller needs of the byte stores, as Protocols, and the null tiers that stand in for absent ones.

The controller is typed against these, not against the concrete pools: the GPU and host pools of `tiers`,
the metadata pools of the replay tool and the test doubles all fit. A server without a host tier or an
L3 gets `NO_HOST` / `NO_L3`: a tier of zero pages that never holds anything, so the controller's parts
need no "is there a host tier" branches; the write policies for an absent tier are `NoWrites`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tiers.base import PageAllocator, PagePool
from tiers.copy import COMPLETED, TransferHandle

# A tier addressed by page id (GPU or host) is `tiers.base.PagePool`: capacity, allocator, allocate, free, used_pages,
# and byte access, which the controller leaves to the copier and the L3 store.
Pool = PagePool


class HostTier(PagePool, Protocol):
    """The host pool, whose pages the L3 store reads and writes in place."""

    def page_view(self, page: int) -> Any: ...


class Copier(Protocol):
    """Page copies between the GPU and host pools (`tiers.copy`)."""

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> TransferHandle: ...

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> TransferHandle: ...


class L3(Protocol):
    """The disk tier as the controller sees it: an index to probe and keys to delete (bytes move through the
    L3 worker)."""

    capacity_pages: int

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def used_pages(self) -> int: ...

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> Any:
        """Forget keys; `wait=False`: the store may make that durable later (the engine thread must not wait for
        the disk), but the keys are not found from now on."""


class Worker(Protocol):
    """What runs the L3's I/O off the engine thread: `tiers.l3.worker.L3Worker` (threads in this process),
    `tiers.l3.process.L3Process`'s worker (a process of its own), the replay's synchronous one, `NO_WORKER`. Writes
    are refused (False) when its queue holds `queue_pages`; `completions()` hands finished jobs
    (`tiers.l3.worker.Completion`) to the engine thread without blocking."""

    queue_pages: int

    @property
    def queued_write_pages(self) -> int: ...

    @property
    def refusal(self) -> str: ...

    def submit_write(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any],
                     before: Callable[[], None] | None = None) -> bool: ...

    def submit_read(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any]) -> None: ...

    def completions(self) -> list[Any]: ...

    def stage(self, pages: Sequence[Any]) -> list[Any] | None: ...

    def wait_idle(self, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...


def page_buffers(host: Any, pages: Sequence[int]) -> list[Any]:
    """The buffers the L3 store reads and writes for these host pages (the ids themselves for a pool without
    bytes)."""
    view = getattr(host, "page_view", None)
    return [view(p) for p in pages] if view is not None else list(pages)


class NoPool:
    """An absent host tier: zero pages, nothing to allocate, free, read or write."""

    page_bytes = 0
    capacity_pages = 0

    def __init__(self) -> None:
        self.allocator = PageAllocator(0, "no host tier")

    def allocate(self, n: int) -> list[int] | None:
        return [] if n == 0 else None

    def free(self, pages: Sequence[int]) -> None:
        if len(pages):
            raise RuntimeError(f"free of {len(pages)} pages in an absent tier")

    def used_pages(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {"capacity_pages": 0, "used_pages": 0}

    def read_pages(self, pages: Sequence[int]) -> Any:
        raise RuntimeError("an absent host tier has no pages")

    def write_pages(self, pages: Sequence[int], data: Any) -> None:
        raise RuntimeError("an absent host tier has no pages")

    def page_view(self, page: int) -> Any:
        raise RuntimeError("an absent host tier has no pages")


class NoL3:
    """An absent disk tier: holds nothing, so every probe misses."""

    capacity_pages = 0

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)

    def used_pages(self) -> int:
        return 0

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> int:
        if len(keys):
            raise RuntimeError(f"delete of {len(keys)} keys in an absent disk tier")
        return 0

    def close(self) -> None:
        return None


class NoWorker:
    """The L3 worker of an absent disk tier: takes no writes, has nothing to report."""

    queue_pages = 0
    queued_write_pages = 0
    refusal = "l3_queue_full"

    def submit_write(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any], before: Any = None) -> bool:
        return False

    def submit_read(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any]) -> None:
        raise RuntimeError("read from an absent disk tier")

    def completions(self) -> list[Any]:
        return []

    def stage(self, pages: Sequence[Any]) -> list[Any] | None:
        return None

    def wait_idle(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        return None


class InstantCopier:
    """Copies that need no bytes moved (metadata pools: the replay tool, tests): done at once."""

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> TransferHandle:
        return COMPLETED

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> TransferHandle:
        return COMPLETED


NO_HOST = NoPool()
NO_L3 = NoL3()
NO_WORKER = NoWorker()
