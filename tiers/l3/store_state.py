"""The state an L3Store's parts share (tiers/l3/store.py, store_open.py, store_write.py, store_read.py), declared
once, and the primitives they all use: index commits, access stamps, slot release and pinning, degrading."""

from __future__ import annotations

import errno
import heapq
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmdb
import torch

from tiers.l3.entry import Entry
from tiers.l3.format import KEY_BYTES, L3Error, index_key
from tiers.l3.lockfile import WriterLock
from tiers.l3.ratelimit import TokenBucket
from tiers.l3.slab import SlabFile

log = logging.getLogger("tiers.l3.store")


class StoreState:
    """L3Store's fields (set by its __init__ and _open) and the primitives its parts share; see L3Store."""

    path: str
    namespace_fields: dict[str, Any]
    page_bytes: int
    namespace: bytes
    read_only: bool
    sync_batch_pages: int
    degraded_retry_s: float
    _lock: threading.Lock
    _counters: Counter[str]
    _entries: OrderedDict[bytes, Entry]
    _free: list[int]
    _pins: Counter[int]
    _deferred_free: set[int]
    _in_flight: dict[bytes, int]
    _limbo: set[int]
    _pending_drops: list[tuple[bytes, int]]
    _read_failures: list[tuple[str, bytes, int, OSError | None]]
    _failures_unlogged: int
    _failures_logged_at: float
    _quarantined: set[int]
    _dirty_access: set[bytes]
    _last_stamp: int
    _admission: Any
    _evicted: list[bytes] | None
    _read_limit: TokenBucket
    _write_limit: TokenBucket
    _state: str
    _degraded_at: float
    _writer_lock: WriterLock | None
    _index: Any
    _slab: SlabFile | None
    _io: Any
    _syncer: ThreadPoolExecutor | None
    _header: Any
    _io_name: str

    @property
    def _open_slab(self) -> SlabFile:
        """The slab of an open store."""
        assert self._slab is not None, "the L3 store is not open"
        return self._slab

    def _commit(self, puts: Sequence[tuple[bytes, bytes]] = (), deletes: Sequence[bytes] = (),
                touches: Sequence[tuple[bytes, int, int]] = ()) -> bool:
        try:
            self._index.commit(puts=puts, deletes=deletes, touches=touches)
        except lmdb.Error as e:
            log.error("%s: index commit failed: %s", self.path, e)
            return False
        with self._lock:
            self._counters["index_commits"] += 1
            self._counters["access_flushes"] += bool(touches)
        return True

    def _commit_drop(self, gone: list[tuple[bytes, int]], release: bool) -> bool:
        """Durably delete index entries of slots in limbo; then free them (release) or keep them for reuse."""
        ok = self._commit(deletes=[index_key(self.namespace, key) for key, _ in gone])
        with self._lock:
            for _, slot in gone:
                self._limbo.discard(slot)
                if not ok:
                    self._quarantined.add(slot)
                elif release:
                    self._release_slot(slot)
        if not ok:
            self._degrade("index delete failed", 0)
        return ok

    def _stamp(self, count: int = 1) -> int:
        """First of `count` strictly increasing access times (caller holds the lock)."""
        first = max(time.time_ns(), self._last_stamp + 1)
        self._last_stamp = first + count - 1
        return first

    def _take_touches(self) -> list[tuple[bytes, int, int]]:
        """Pending access-time updates (caller holds the lock)."""
        touches = []
        for key in self._dirty_access:
            entry = self._entries.get(key)
            if entry is not None:
                touches.append((index_key(self.namespace, key), entry.slot, entry.access_ns))
        self._dirty_access.clear()
        return touches

    def _release_slot(self, slot: int) -> None:
        if self._pins[slot]:
            self._deferred_free.add(slot)
        else:
            heapq.heappush(self._free, slot)

    def _unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]
            if slot in self._deferred_free:
                self._deferred_free.discard(slot)
                heapq.heappush(self._free, slot)

    def _degrade(self, reason: str, pages: int) -> None:
        with self._lock:
            self._counters["write_errors"] += pages
            if self._state != "degraded":
                log.error("%s: %s; L3 store degraded (writes refused for %.0f s, reads continue)",
                          self.path, reason, self.degraded_retry_s)
            self._state = "degraded"
            self._degraded_at = time.monotonic()

    @property
    def capacity_pages(self) -> int:
        """Hard cap on stored pages (slots in the slab)."""
        return int(self._header.slot_count)

    def _commit_pending_drops(self) -> None:
        """Durably drop the index entries `delete(wait=False)` removed, and free their slots."""
        with self._lock:
            gone, self._pending_drops = self._pending_drops, []
        if gone:
            self._commit_drop(gone, release=True)

    def flush(self) -> None:
        """Write pending access times (LRU recency) to the index."""
        if self.read_only or self._index is None:
            return
        self._commit_pending_drops()
        with self._lock:
            touches = self._take_touches()
        if touches:
            self._commit(touches=touches)

    def _check_batch(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> None:
        if self._index is None:
            raise L3Error(errno.EBADF, f"{self.path}: L3 store is closed")
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} pages")
        for key, tensor in zip(keys, tensors):
            if len(key) != KEY_BYTES:
                raise ValueError(f"page key must be {KEY_BYTES} bytes, got {len(key)}")
            if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() != self.page_bytes \
                    or not tensor.is_contiguous():
                raise ValueError(f"page must be a contiguous 1-D uint8 tensor of {self.page_bytes} bytes, "
                                 f"got {tuple(tensor.shape)} {tensor.dtype}")
