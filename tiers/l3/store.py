"""L3Store: a synchronous, thread-safe NVMe page store (slab of slots + LMDB index), LRU-capped.

Its parts: opening and recovery (store_open.py), writes (store_write.py), reads (store_read.py); here the state
they share, the public calls that are neither, and the index commits."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmdb

from tiers.l3.admission import admission_policy
from tiers.l3.entry import READ_FAILURE_LOG_S, Entry
from tiers.l3.format import FORMAT_VERSION, NAMESPACE_BYTES, L3Error
from tiers.l3.lockfile import WriterLock
from tiers.l3.ratelimit import TokenBucket
from tiers.l3.slab import SlabFile
from tiers.l3.store_open import StoreOpening
from tiers.l3.store_read import StoreReads
from tiers.l3.store_write import StoreWrites

log = logging.getLogger(__name__)

IO_BACKENDS = ("auto", "kvikio", "posix", "buffered")
COUNTERS = ("writes", "write_bytes", "reads", "read_bytes", "hits", "misses", "checksum_failures",
            "short_reads", "read_errors", "evictions", "write_errors", "write_refused", "not_admitted",
            "already_present", "busy", "no_slot", "deletes", "fsyncs", "index_commits", "index_resets",
            "dropped_entries", "access_flushes")


class L3Store(StoreOpening, StoreWrites, StoreReads):
    """Pages (1-D uint8 tensors of page_bytes) under 16-byte keys, in a preallocated slab file on NVMe.

    write_pages returns only after the data is fdatasync'd and the index entries are committed. Reads
    verify an xxh3_64 checksum and treat any mismatch as a miss (the entry is dropped). The store is safe
    to call from many threads; I/O runs outside its lock.
    """

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, page_bytes: int, namespace: bytes,
                 io_backend: str = "auto", io_threads: int = 4, sync_batch_pages: int = 32,
                 admission_hits: int = 0, read_only: bool = False, max_io_bytes: int = 16 << 20,
                 degraded_retry_s: float = 30.0, read_limit_bytes_per_s: float = 0.0,
                 write_limit_bytes_per_s: float = 0.0, namespace_fields: dict[str, Any] | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        # what the namespace fingerprints (model, dtype, layout, page size, rank), kept beside the slab so that a
        # server opening the store with other settings is told which ones differ
        self.namespace_fields = dict(namespace_fields or {})
        if io_backend not in IO_BACKENDS:
            raise L3Error(errno.EINVAL, f"{self.path}: io_backend {io_backend!r} not in {IO_BACKENDS}")
        if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
            raise L3Error(errno.EINVAL, f"{self.path}: namespace must be {NAMESPACE_BYTES} bytes")
        if page_bytes <= 0:
            raise L3Error(errno.EINVAL, f"{self.path}: page_bytes must be positive, got {page_bytes}")
        self.page_bytes = page_bytes
        self.namespace = namespace
        self.read_only = read_only
        self.sync_batch_pages = max(1, sync_batch_pages)
        self.degraded_retry_s = degraded_retry_s
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self._free: list[int] = []  # min-heap, so a batch gets adjacent slots
        self._pins: Counter[int] = Counter()  # slots being read
        self._deferred_free: set[int] = set()  # released while pinned; freed on the last unpin
        self._in_flight: dict[bytes, int] = {}  # key -> slot being written
        self._limbo: set[int] = set()  # removed from memory, index delete not yet committed
        self._pending_drops: list[tuple[bytes, int]] = []  # delete(wait=False): (key, slot) awaiting their commit
        self._read_failures: list[tuple[str, bytes, int, OSError | None]] = []  # this read call's, for the log
        self._failures_unlogged = 0
        self._failures_logged_at = -READ_FAILURE_LOG_S
        self._quarantined: set[int] = set()  # index state unknown after an error; unused until reopen
        self._dirty_access: set[bytes] = set()
        self._last_stamp = 0  # access times are strictly increasing, so LRU order survives a reopen
        self._admission = admission_policy(admission_hits)
        self._evicted: list[bytes] | None = None  # keys evicted to make room, kept once `track_evictions` is on
        # bandwidth caps (0: none): an NVMe of a given speed emulated on tmpfs, or this server's share of a disk
        self._read_limit = TokenBucket(read_limit_bytes_per_s)
        self._write_limit = TokenBucket(write_limit_bytes_per_s)
        self._state = "read_only" if read_only else "ok"
        self._degraded_at = 0.0
        self._writer_lock: WriterLock | None = None
        self._index = None
        self._slab: SlabFile | None = None
        self._io = None
        self._syncer: ThreadPoolExecutor | None = None  # a group's fdatasync + commit while the next writes
        try:
            self._open(capacity_bytes, io_backend, io_threads, max_io_bytes)
        except BaseException:
            self._release()
            raise

    # ---- public API ----

    @property
    def io_backend(self) -> str:
        """The data path in use: "kvikio", "posix" (O_DIRECT), "buffered", or "mapped" (a slab in memory, read from a
        mapping of it)."""
        return self._io_name

    def settle(self, timeout: float | None = None) -> bool:
        """Block until the store's start-up work in the background is done (a slab in memory is mapped in: until
        then, slots past the mapped part move by pread/pwrite, and the mapping takes a core); True once done, False on
        timeout. A server need not call it; a benchmark of steady throughput does."""
        settle = getattr(self._io, "settle", None)
        return settle(timeout) if settle is not None else True

    def used_pages(self) -> int:
        """Pages currently indexed."""
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[bytes]:
        """Stored page keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Index probe (in memory, no I/O)."""
        with self._lock:
            return [key in self._entries for key in keys]

    def note_hit(self, keys: Sequence[bytes]) -> None:
        """Count a sighting of each key for the admission rule."""
        with self._lock:
            self._admission.note(keys)

    def track_evictions(self) -> None:
        """Keep the keys of pages evicted to make room for writes until `take_evicted` (an engine's KV events
        announce them); off by default, as the server's tree learns of evictions from its own writes."""
        with self._lock:
            if self._evicted is None:
                self._evicted = []

    def take_evicted(self) -> list[bytes]:
        """Keys evicted to make room since the last call (empty unless `track_evictions` is on)."""
        with self._lock:
            if not self._evicted:
                return []
            taken, self._evicted = self._evicted, []
            return taken

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> int:
        """Remove pages from the index; returns how many were present. They are gone at once (not found, not
        read); with `wait` the index drop is durable on return, else it commits before the next write (on the
        writer's thread), at `flush` or at `close`: an engine thread that evicts disk pages never waits for the
        disk. Until then their slots are not reused, so a crash in between brings the pages back intact."""
        self._check_writable()
        with self._lock:
            gone = []
            for key in dict.fromkeys(keys):
                entry = self._entries.pop(key, None)
                if entry is not None:
                    self._limbo.add(entry.slot)
                    gone.append((key, entry.slot))
            self._counters["deletes"] += len(gone)
            if not wait:
                self._pending_drops.extend(gone)
        if gone and wait:
            self._commit_drop(gone, release=True)
        return len(gone)

    def discard(self, keys: Sequence[bytes]) -> int:
        """Delete pages wherever they are kept: here, `delete` (a store with a remote tier behind it also deletes
        the shared copies, tiers/persistent.py)."""
        return self.delete(keys)

    def stats(self) -> dict[str, Any]:
        """Size, state, active I/O path and counters."""
        with self._lock:
            return {
                "path": self.path, "pages": len(self._entries), "bytes": len(self._entries) * self.page_bytes,
                "capacity": self.capacity_pages, "capacity_pages": self.capacity_pages,
                "capacity_bytes": self.capacity_pages * self.page_bytes, "page_bytes": self.page_bytes,
                "slot_bytes": self._header.slot_bytes, "free_pages": len(self._free),
                "format_version": FORMAT_VERSION, "io_backend": self._io_name, "state": self._state,
                "read_limit_gbps": self._read_limit.rate / 1e9, "write_limit_gbps": self._write_limit.rate / 1e9,
                "read_limit_wait_s": self._read_limit.waited_s, "write_limit_wait_s": self._write_limit.waited_s,
                **self._counters,
            }

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every slot is in exactly one place (free, owned, or in transition)."""
        with self._lock:
            owned = [e.slot for e in self._entries.values()]
            in_flight = [slot for slot in self._in_flight.values() if slot >= 0]
            groups = [self._free, owned, in_flight, list(self._limbo),
                      list(self._deferred_free), list(self._quarantined)]
            every = [slot for group in groups for slot in group]
            if len(every) != len(set(every)):
                raise RuntimeError(f"{self.path}: a slot is in two places")
            if set(every) != set(range(self.capacity_pages)):
                raise RuntimeError(f"{self.path}: {self.capacity_pages - len(set(every))} slots unaccounted")
            if not set(self._pins) <= set(owned) | self._deferred_free | self._limbo:
                raise RuntimeError(f"{self.path}: a pinned slot is free")

    def close(self) -> None:
        """Flush access times and release files, the index and the writer lock. Idempotent."""
        if self._index is not None and not self.read_only:
            try:
                self.flush()
            except lmdb.Error as e:
                log.warning("%s: access times not flushed on close: %s", self.path, e)
        self._release()

    def __enter__(self) -> L3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----

    def _release(self) -> None:
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None
        for resource in (self._io, self._slab, self._index):
            if resource is not None:
                resource.close()
        self._io = self._slab = self._index = None
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None
