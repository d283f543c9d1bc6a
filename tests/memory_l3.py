"""An in-memory L3 stand-in with real bytes, for controller tests (tests only)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class MemoryL3:
    """An in-memory L3 store with bytes, LRU capacity and the L3Store's batch calls."""

    def __init__(self, capacity_pages: int, page_bytes: int):
        self.capacity_pages = capacity_pages
        self.page_bytes = page_bytes
        self.data: dict[bytes, bytes] = {}
        self.fail_writes = False
        self.corrupt: set[bytes] = set()

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.data for k in keys]

    def write_pages(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor]) -> list[bool]:
        if self.fail_writes:
            return [False] * len(keys)
        for k, p in zip(keys, pages):
            if k not in self.data:
                while len(self.data) >= self.capacity_pages:
                    del self.data[next(iter(self.data))]
                self.data[k] = p.numpy().tobytes()
        return [True] * len(keys)

    def read_pages(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        res = []
        for k, o in zip(keys, out):
            if k not in self.data or k in self.corrupt:
                self.data.pop(k, None)
                res.append(False)
                continue
            o.copy_(torch.frombuffer(bytearray(self.data[k]), dtype=torch.uint8))
            res.append(True)
        return res

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    def discard(self, keys: Sequence[bytes]) -> int:
        return self.delete(keys)

    def used_pages(self) -> int:
        return len(self.data)

    def stats(self) -> dict:
        return {"used_pages": len(self.data)}

    def close(self) -> None:
        pass
