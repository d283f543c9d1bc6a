"""The narrow tier interface, the page allocator, and the KV shape every pool shares."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV of one model rank: what a page holds."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    itemsize: int  # bytes per element of the KV dtype

    @property
    def page_elements(self) -> int:
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.page_elements * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.page_size


@runtime_checkable
class PageStore(Protocol):
    """What every tier offers: a fixed capacity of fixed-size pages, and stats."""

    page_bytes: int
    capacity_pages: int

    def used_pages(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class PagePool(PageStore, Protocol):
    """A tier addressed by page id (GPU and host): allocate, free, read and write pages."""

    allocator: PageAllocator

    def allocate(self, n: int) -> list[int] | None: ...

    def free(self, pages: Sequence[int]) -> None: ...

    def read_pages(self, pages: Sequence[int]) -> Any: ...

    def write_pages(self, pages: Sequence[int], data: Any) -> None: ...


class AllocatorBacked:
    """allocate / free / used_pages of a pool, delegated to its `allocator` (shared by the pools)."""

    allocator: PageAllocator

    def allocate(self, n: int) -> list[int] | None:
        return self.allocator.allocate(n)

    def free(self, pages: Sequence[int]) -> None:
        self.allocator.free(pages)

    def used_pages(self) -> int:
        return self.allocator.used_pages


class PageAllocator:
    """Free list of page ids [0, capacity) that detects double allocation and double free."""

    def __init__(self, capacity: int, name: str = "pool"):
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first
        self._owned = bytearray(capacity)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n free page ids, or None (allocating nothing) if fewer than n are free."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        owned = self._owned
        for p in pages:
            if owned[p]:
                raise RuntimeError(f"{self.name}: page {p} allocated twice (free list corrupted)")
            owned[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list; raises on a page that is out of range or not allocated."""
        owned = self._owned
        pages = list(pages)
        for p in pages:
            if not 0 <= p < self.capacity:
                raise ValueError(f"{self.name}: page {p} out of range [0, {self.capacity})")
            if not owned[p]:
                raise RuntimeError(f"{self.name}: double free of page {p}")
            owned[p] = 0
        # descending, so that pop() hands them out ascending: a freed run comes back as a run, which the
        # copiers move in one copy (as handed out before, descending, every page was its own copy)
        self._free.extend(sorted(pages, reverse=True))

    def check_integrity(self, owned: Iterable[int]) -> None:
        """Free + owned == capacity with no page owned twice; `owned` is every page a user holds."""
        owned = list(owned)
        if len(set(owned)) != len(owned):
            raise AssertionError(f"{self.name}: a page is owned twice")
        if len(set(self._free)) != len(self._free):
            raise AssertionError(f"{self.name}: a page is free twice")
        if set(owned) & set(self._free):
            raise AssertionError(f"{self.name}: a page is both free and owned")
        if len(owned) + len(self._free) != self.capacity:
            raise AssertionError(
                f"{self.name}: free {len(self._free)} + owned {len(owned)} != capacity {self.capacity}"
            )
        if sum(self._owned) != len(owned):
            raise AssertionError(f"{self.name}: allocation bitmap disagrees with owners")
