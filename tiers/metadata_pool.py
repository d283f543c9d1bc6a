"""A pool with page ids and no bytes: the null object used by the offline replay tool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiers.base import AllocatorBacked, PageAllocator


class MetadataPool(AllocatorBacked):
    """Allocates page ids for `capacity_pages` pages of `page_bytes` each, stores nothing."""

    def __init__(self, capacity_pages: int, page_bytes: int, name: str = "metadata"):
        self.name = name
        self.page_bytes = page_bytes
        self.capacity_pages = capacity_pages
        self.allocator = PageAllocator(capacity_pages, name)

    def read_pages(self, pages: Sequence[int]) -> Any:
        return None

    def write_pages(self, pages: Sequence[int], data: Any) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"capacity_pages": self.capacity_pages, "used_pages": self.used_pages()}


class MetadataL3:
    """An L3 index with no bytes: keys and a capacity (replay). Same calls as the real L3 store."""

    def __init__(self, capacity_pages: int, page_bytes: int = 0):
        self.capacity_pages = capacity_pages
        self.page_bytes = page_bytes
        self._keys: dict[bytes, None] = {}  # insertion-ordered: oldest first
        self.evictions = 0

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._keys for k in keys]

    def write_pages(self, keys: Sequence[bytes], pages: Sequence[Any]) -> list[bool]:
        for k in keys:
            if k in self._keys:
                continue
            while len(self._keys) >= self.capacity_pages:  # the store's own cap, as the real one
                del self._keys[next(iter(self._keys))]
                self.evictions += 1
            self._keys[k] = None
        return [True] * len(keys)

    def read_pages(self, keys: Sequence[bytes], out: Sequence[Any]) -> list[bool]:
        return [k in self._keys for k in keys]

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> int:
        n = 0
        for k in keys:
            if self._keys.pop(k, 0) is None:
                n += 1
        return n

    def used_pages(self) -> int:
        return len(self._keys)

    def stats(self) -> dict[str, Any]:
        return {"capacity_pages": self.capacity_pages, "used_pages": len(self._keys), "io_backend": "metadata"}

    def close(self) -> None:
        return None
