"""L3Store: a synchronous, thread-safe NVMe page store (slab of slots + LMDB index), LRU-capped."""

from __future__ import annotations

import errno
import heapq
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import lmdb
import torch

from tiers.l3.admission import admission_policy
from tiers.l3.format import (
    FORMAT_VERSION,
    KEY_BYTES,
    NAMESPACE_BYTES,
    IndexRecord,
    L3Error,
    SlabHeader,
    VersionMismatch,
    bound_checksum,
    index_key,
    slot_bytes_for,
)
from tiers.l3.identity import allocated_slots, namespace_difference, write_namespace_fields
from tiers.l3.index import INDEX_NAME, index_map_bytes, move_aside, open_index
from tiers.l3.io import KvikioSlotIO, PosixSlotIO, kvikio_compat_mode, kvikio_usable
from tiers.l3.lockfile import WriterLock, prepare_directory
from tiers.l3.ratelimit import TokenBucket
from tiers.l3.slab import SlabFile, create_slab, read_header, slab_path

log = logging.getLogger(__name__)

IO_BACKENDS = ("auto", "kvikio", "posix", "buffered")
COUNTERS = ("writes", "write_bytes", "reads", "read_bytes", "hits", "misses", "checksum_failures",
            "short_reads", "read_errors", "evictions", "write_errors", "write_refused", "not_admitted",
            "already_present", "busy", "no_slot", "deletes", "fsyncs", "index_commits", "index_resets",
            "dropped_entries", "access_flushes")
READ_FAILURE_LOG_S = 10.0  # at most one log line of failed reads this often (all are counted in the stats)
TOUCH_FLUSH_ENTRIES = 4096  # flush in-memory access times once this many are pending


@dataclass
class _Entry:
    slot: int
    checksum: int
    access_ns: int


class L3Store:
    """Pages (1-D uint8 tensors of page_bytes) under 16-byte keys, in a preallocated slab file on NVMe.

    write_pages returns only after the data is fdatasync'd and the index entries are committed. Reads
    verify an xxh3_64 checksum and treat any mismatch as a miss (the entry is dropped). The store is safe
    to call from many threads; I/O runs outside its lock.
    """

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, page_bytes: int, namespace: bytes,
                 io_backend: str = "auto", io_threads: int = 4, sync_batch_pages: int = 32,
                 admission_hits: int = 0, read_only: bool = False, max_io_bytes: int = 16 << 20,
                 degraded_retry_s: float = 30.0, read_limit_bytes_per_s: float = 0.0,
                 write_limit_bytes_per_s: float = 0.0, namespace_fields: dict | None = None) -> None:
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
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
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

    # ---- open ----

    def _open(self, capacity_bytes: int, io_backend: str, io_threads: int, max_io_bytes: int) -> None:
        prepare_directory(self.path, self.read_only)
        if not self.read_only:
            self._writer_lock = WriterLock(self.path)
        slot_bytes = slot_bytes_for(self.page_bytes)
        slot_count = capacity_bytes // slot_bytes
        if slot_count < 1:
            raise L3Error(errno.EINVAL,
                          f"{self.path}: capacity {capacity_bytes} B holds no {slot_bytes} B slot")
        file = slab_path(self.path)
        header, reason = self._check_header(file)
        if header is None and self.read_only:
            raise L3Error(errno.ENOENT, f"{file}: no usable slab ({reason})")
        map_bytes = index_map_bytes(max(slot_count, header.slot_count if header else 0))
        index_existed = os.path.exists(os.path.join(self.path, INDEX_NAME))
        self._index, resets = open_index(self.path, map_bytes, self.read_only)
        if header is not None and not index_existed:
            lost = allocated_slots(file, header.slot_bytes)
            log.warning("%s: the index (%s) is missing: the slab's pages cannot be found without it. About %d "
                        "pages written before are lost; the store starts empty and reuses their slots", self.path,
                        INDEX_NAME, lost)
            self._counters["dropped_entries"] += lost
        self._counters["index_resets"] += resets
        if header is None:
            stale = self._index.count()
            if stale and reason == "missing":
                log.error("%s: slab missing; dropping %d index entries", file, stale)
                self._index.clear()
                self._counters["dropped_entries"] += stale
            elif stale:
                self._index.close()
                move_aside(self.path, f"slab header unreadable: {reason}")
                self._index, _ = open_index(self.path, map_bytes, self.read_only)
                self._counters["index_resets"] += 1
            create_slab(file, SlabHeader(self.namespace, self.page_bytes, slot_bytes, slot_count,
                                         created_ns=time.time_ns()))
            header = read_header(file)
            if self.namespace_fields:
                write_namespace_fields(self.path, self.namespace_fields)
        use_kvikio = self._pick_kvikio(io_backend)
        self._slab = SlabFile(file, header, self.read_only, want_direct=io_backend != "buffered")
        self._load(slot_count)
        if use_kvikio:
            self._io = KvikioSlotIO(self._slab, self.page_bytes, io_threads)
        else:
            # "auto": a slab in memory (tmpfs) is read from a mapping; "posix" and "buffered" always pread
            self._io = PosixSlotIO(self._slab, self.page_bytes, io_threads, max_io_bytes,
                                   map_reads=None if io_backend == "auto" else False)
        self._header = self._slab.header
        self._io_name = self._io.name
        log.info("%s: L3 store open, %d/%d pages, io_backend=%s, state=%s", self.path, len(self._entries),
                 self.capacity_pages, self._io.name, self._state)

    def _check_header(self, file: str) -> tuple[SlabHeader | None, str]:
        """The slab header if usable; (None, reason) if missing or unreadable; L3Error on a mismatch."""
        try:
            header = read_header(file)
        except FileNotFoundError:
            return None, "missing"
        except VersionMismatch as e:
            raise L3Error(errno.EPROTO, f"{file}: {e}; refusing to touch it (remove {self.path} to start "
                                        "over, or open it with a matching hicache version)") from e
        except (ValueError, OSError) as e:
            log.error("%s: slab header unreadable: %s", file, e)
            return None, str(e)
        if header.namespace != self.namespace:
            raise L3Error(errno.EINVAL, f"{self.path}: this store holds the KV pages of other settings: "
                                        f"{namespace_difference(self.path, self.namespace_fields)}. Its pages "
                                        "cannot be served with these settings: give this server another L3 "
                                        f"directory (cache.l3.path), or remove {self.path} to start over")
        if header.page_bytes != self.page_bytes or header.slot_bytes != slot_bytes_for(self.page_bytes):
            raise L3Error(errno.EINVAL, f"{file}: store page_bytes {header.page_bytes} differs from "
                                        f"requested {self.page_bytes}")
        return header, ""

    def _pick_kvikio(self, io_backend: str) -> bool:
        """kvikio when asked for; with "auto" only where GPUDirect Storage is active (not kvikio's compat mode)."""
        if io_backend not in ("auto", "kvikio"):
            return False
        usable, why = kvikio_usable()
        if io_backend == "kvikio" and not usable:
            raise L3Error(errno.ENOTSUP, f"{self.path}: io_backend='kvikio' requested but {why}")
        if io_backend == "auto" and usable and kvikio_compat_mode():
            log.info("%s: kvikio runs in compatibility mode here (no GPUDirect Storage): using POSIX I/O", self.path)
            return False
        return usable

    def _load(self, slot_count: int) -> None:
        """Rebuild the LRU order and the free list from the index; drop entries that cannot be valid."""
        header = self._slab.header
        on_disk = self._slab.slots_on_disk()
        keep = header.slot_count if self.read_only else min(slot_count, header.slot_count)
        used: set[int] = set()
        bad: list[bytes] = []
        records: list[tuple[bytes, IndexRecord]] = []
        for key, value in self._index.items():
            if len(key) != NAMESPACE_BYTES + KEY_BYTES or key[:NAMESPACE_BYTES] != self.namespace:
                if not self.read_only:
                    bad.append(key)
                continue
            try:
                record = IndexRecord.unpack(value)
            except ValueError:
                bad.append(key)
                continue
            if (record.version != FORMAT_VERSION or record.length != self.page_bytes or record.slot in used
                    or record.slot >= min(on_disk, keep)):
                bad.append(key)  # beyond EOF (truncated slab), beyond a shrunk capacity, or malformed
                continue
            used.add(record.slot)
            records.append((key[NAMESPACE_BYTES:], record))
        if bad:
            log.warning("%s: dropping %d index entries that point outside the slab or are malformed",
                        self.path, len(bad))
            self._counters["dropped_entries"] += len(bad)
            if not self.read_only:
                self._index.commit(deletes=bad)
        if not self.read_only:
            if slot_count != header.slot_count:
                self._index.grow(index_map_bytes(slot_count))
                self._slab.resize(slot_count)
            else:
                self._slab.ensure_size()
        records.sort(key=lambda item: item[1].last_access_ns)
        self._last_stamp = records[-1][1].last_access_ns if records else 0
        for key, record in records:
            self._entries[key] = _Entry(record.slot, record.checksum, record.last_access_ns)
        self._free = [slot for slot in range(self._slab.header.slot_count) if slot not in used]

    # ---- public API ----

    @property
    def capacity_pages(self) -> int:
        """Hard cap on stored pages (slots in the slab)."""
        return self._header.slot_count

    @property
    def io_backend(self) -> str:
        """The data path in use: "kvikio", "posix" (O_DIRECT), "buffered", or "mapped" (a slab in memory, read from a
        mapping of it)."""
        return self._io_name

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

    def write_pages(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store pages; True = durably written and indexed, or already present.

        False: not admitted, store degraded, key being written by another call, or an I/O error.
        Evicts least recently used pages when the slab is full.
        """
        return self.write_pages_detailed(keys, pages)[0]

    def write_pages_detailed(self, keys: Sequence[bytes],
                             pages: Sequence[torch.Tensor]) -> tuple[list[bool], list[str | None]]:
        """`write_pages`, with why each refused page was refused: "not_admitted" (the admission rule), "busy"
        (another call is writing the key), "degraded" (the store refuses writes for now) or "failed" (no slot,
        an I/O, sync or index error); None where the page is stored."""
        self._check_writable()
        self._check_batch(keys, pages)
        self._commit_pending_drops()  # their slots are free for this batch
        results = [False] * len(keys)
        reasons: list[str | None] = [None] * len(keys)
        todo = self._plan_writes(keys, results, reasons)
        if todo:
            self._write_planned(keys, pages, todo, results)
        first: dict[bytes, int] = {}
        for i, key in enumerate(keys):  # a repeated key shares its first occurrence's outcome
            j = first.setdefault(key, i)
            results[i] = results[j]
            reasons[i] = None if results[i] else reasons[j] or "failed"
        return results, reasons

    def _write_planned(self, keys, pages, todo: list[int], results: list[bool]) -> None:
        victims, slots = self._allocate([keys[i] for i in todo], protect=set(keys))
        if victims and not self._commit_drop(victims, release=False):
            slots = []  # the victims' index state is unknown (now quarantined): write nothing
            with self._lock:
                for slot in set(self._in_flight[keys[i]] for i in todo) - {s for _, s in victims} - {-1}:
                    heapq.heappush(self._free, slot)
        with self._lock:
            for i in todo[len(slots):]:
                self._in_flight.pop(keys[i], None)
            self._counters["no_slot"] += len(todo) - len(slots)
        todo = todo[:len(slots)]
        # pages [g, g + sync_batch_pages) share one fdatasync and one index transaction; a group's sync and
        # commit run on the syncer thread while the next group is written, so the disk never waits for
        # them (fdatasync covers every write completed before it starts: the group's own, at least)
        step = self.sync_batch_pages
        groups = [(todo[g:g + step], slots[g:g + step]) for g in range(0, len(todo), step)]
        previous = None
        try:
            for group, group_slots in groups:
                if self._state == "degraded":
                    self._finish_writes(keys, group, group_slots, [None] * len(group), results)
                    continue
                self._write_limit.take(len(group) * self.page_bytes)
                outcomes = self._io.write(group_slots, [pages[i] for i in group])
                if previous is not None:
                    previous.result()
                    previous = None
                if len(groups) == 1:
                    self._sync_and_finish(keys, group, group_slots, outcomes, results)
                else:
                    if self._syncer is None:
                        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-sync")
                    previous = self._syncer.submit(self._sync_and_finish, keys, group, group_slots, outcomes,
                                                   results)
        finally:
            if previous is not None:
                previous.result()

    def read_pages(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        """Copy stored pages into `out`; True only if the bytes verified against the stored checksum.

        A checksum mismatch or a short read is a miss: logged, counted, and the entry is dropped.
        """
        self._check_batch(keys, out)
        results = [False] * len(keys)
        plan: list[tuple[int, int, int]] = []  # (item, slot, checksum)
        with self._lock:
            self._counters["reads"] += len(keys)
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None:
                    self._counters["misses"] += 1
                    continue
                self._pins[entry.slot] += 1
                plan.append((i, entry.slot, entry.checksum))
        if not plan:
            return results
        self._read_limit.take(len(plan) * self.page_bytes)
        outcomes = self._io.read([slot for _, slot, _ in plan], [out[i] for i, _, _ in plan])
        bad: list[tuple[bytes, int]] = []
        with self._lock:
            for (i, slot, digest), outcome in zip(plan, outcomes):
                self._unpin(slot)
                entry = self._entries.get(keys[i])
                if outcome.error is None and bound_checksum(self.namespace, keys[i], outcome.digest) == digest:
                    results[i] = True
                    self._counters["hits"] += 1
                    self._counters["read_bytes"] += self.page_bytes
                    if entry is not None and entry.slot == slot and not self.read_only:
                        entry.access_ns = self._stamp()
                        self._entries.move_to_end(keys[i])
                        self._dirty_access.add(keys[i])
                    continue
                self._counters["misses"] += 1
                drop = self._count_read_failure(keys[i], slot, outcome.error)
                if drop and entry is not None and entry.slot == slot and not self.read_only:
                    del self._entries[keys[i]]
                    self._limbo.add(slot)
                    bad.append((keys[i], slot))
            flush = len(self._dirty_access) >= TOUCH_FLUSH_ENTRIES
        if bad:
            self._commit_drop(bad, release=True)
        if flush:
            self.flush()
        self._log_read_failures()
        return results

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
        """Delete pages wherever they are kept: here, `delete` (a store with a shared tier behind it also deletes
        the shared copies, tiers/persistent.py)."""
        return self.delete(keys)

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

    def stats(self) -> dict:
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

    def __exit__(self, *exc) -> None:
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

    def _check_writable(self) -> None:
        if self.read_only:
            raise L3Error(errno.EROFS, f"{self.path}: L3 store opened read-only")
        if self._index is None:
            raise L3Error(errno.EBADF, f"{self.path}: L3 store is closed")

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

    def _plan_writes(self, keys: Sequence[bytes], results: list[bool], reasons: list[str | None]) -> list[int]:
        """Indices of keys this call will write (admitted, absent, not in flight); marks present ones True and
        notes why the others are refused."""
        with self._lock:
            if self._state == "degraded":
                if time.monotonic() - self._degraded_at < self.degraded_retry_s:
                    self._counters["write_refused"] += len(keys)
                    reasons[:] = ["degraded"] * len(keys)
                    return []
                log.info("%s: degraded; probing with a write", self.path)
                self._state = "probing"
            candidates = []
            firsts: dict[bytes, int] = {}
            for i, key in enumerate(keys):
                if firsts.setdefault(key, i) != i:
                    continue  # a repeat: write_pages copies the first occurrence's outcome
                if key in self._entries:
                    results[i] = True
                    self._counters["already_present"] += 1
                    self._entries.move_to_end(key)  # a re-offered page is hot
                    self._entries[key].access_ns = self._stamp()
                    self._dirty_access.add(key)
                elif key in self._in_flight:
                    self._counters["busy"] += 1
                    reasons[i] = "busy"
                else:
                    candidates.append(i)
            admitted = self._admission.admit([keys[i] for i in candidates])
            self._counters["not_admitted"] += admitted.count(False)
            for i, ok in zip(candidates, admitted):
                if not ok:
                    reasons[i] = "not_admitted"
            todo = [i for i, ok in zip(candidates, admitted) if ok]
            for i in todo:
                self._in_flight[keys[i]] = -1
            return todo

    def _allocate(self, keys: list[bytes], protect: set[bytes]) -> tuple[list[tuple[bytes, int]], list[int]]:
        """Slots for `keys` (in order), evicting least recently used pages; returns (victims, slots).

        Pages being read and pages named in this batch (`protect`) are never victims.
        """
        with self._lock:
            slots = [heapq.heappop(self._free) for _ in range(min(len(keys), len(self._free)))]
            victims = []
            if len(slots) < len(keys):
                for key, entry in self._entries.items():
                    if len(slots) + len(victims) == len(keys):
                        break
                    if entry.slot not in self._pins and key not in protect:
                        victims.append((key, entry.slot))
                for key, _ in victims:
                    del self._entries[key]  # its slot is now in flight to the writer
                self._counters["evictions"] += len(victims)
            slots += [slot for _, slot in victims]
            slots.sort()
            for key, slot in zip(keys, slots):
                self._in_flight[key] = slot
            return victims, slots

    def _sync_and_finish(self, keys, group: list[int], slots: list[int], outcomes, results: list[bool]) -> None:
        """Sync one written group and commit its index entries (none once an earlier group degraded the store)."""
        digests = [None] * len(group) if self._state == "degraded" else self._sync_group(outcomes)
        self._finish_writes(keys, group, slots, digests, results)

    def _sync_group(self, outcomes) -> list[int | None]:
        """fdatasync a written group; returns each page's checksum, None where the write or sync failed."""
        digests = [o.digest if o.error is None else None for o in outcomes]
        failed = [o.error for o in outcomes if o.error is not None]
        if failed:
            self._degrade(f"write failed for {len(failed)} pages: {failed[0]}", len(failed))
        if any(d is not None for d in digests):
            try:
                self._slab.sync()
                with self._lock:
                    self._counters["fsyncs"] += 1
            except OSError as e:
                self._degrade(f"fdatasync failed: {e}", sum(d is not None for d in digests))
                digests = [None] * len(digests)
        return digests

    def _finish_writes(self, keys, group: list[int], slots: list[int], digests: list[int | None],
                       results: list[bool]) -> None:
        """Commit the written pages' index entries; failed pages' slots go back to the free list."""
        with self._lock:
            first = self._stamp(len(group))
            touches = self._take_touches()
        stamps = range(first, first + len(group))  # group order is LRU order
        digests = [None if d is None else bound_checksum(self.namespace, keys[i], d) for i, d in zip(group, digests)]
        puts = [(index_key(self.namespace, keys[i]), IndexRecord(slot, self.page_bytes, d, t).pack())
                for i, slot, d, t in zip(group, slots, digests, stamps) if d is not None]
        committed = bool(puts or touches) and self._commit(puts=puts, touches=touches)
        if puts and not committed:
            self._degrade("index commit failed", len(puts))
        with self._lock:
            for i, slot, d, t in zip(group, slots, digests, stamps):
                del self._in_flight[keys[i]]
                if d is not None and committed:
                    self._entries[keys[i]] = _Entry(slot, d, t)
                    results[i] = True
                    self._counters["writes"] += 1
                    self._counters["write_bytes"] += self.page_bytes
                elif d is not None:
                    self._quarantined.add(slot)  # commit outcome unknown
                else:
                    heapq.heappush(self._free, slot)  # never indexed: safe to reuse
            if committed and puts:
                self._admission.forget([keys[i] for i in group])
                if self._state == "probing":
                    log.info("%s: write probe succeeded; state ok", self.path)
                    self._state = "ok"

    def _commit(self, puts=(), deletes=(), touches=()) -> bool:
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

    def _count_read_failure(self, key: bytes, slot: int, error: OSError | None) -> bool:
        """Count a failed read and note it for the batch's one log line (caller holds the lock); True if the
        entry must be dropped."""
        if error is None:
            kind, drop = "checksum_failures", True
        elif error.errno == errno.ENODATA:
            kind, drop = "short_reads", True
        else:
            kind, drop = "read_errors", False
        self._counters[kind] += 1
        self._read_failures.append((kind, key, slot, error))
        return drop

    def _log_read_failures(self) -> None:
        """One ERROR line for a read call's failed pages (a corrupted store would print one per page), with the
        counts by kind and the first page; at most one line per READ_FAILURE_LOG_S, the rest counted in it."""
        with self._lock:
            failures, self._read_failures = self._read_failures, []
            self._failures_unlogged += len(failures)
            now = time.monotonic()
            if not failures or now - self._failures_logged_at < READ_FAILURE_LOG_S:
                return
            count, self._failures_unlogged = self._failures_unlogged, 0
            self._failures_logged_at = now
            totals = {k: self._counters[k] for k in ("checksum_failures", "short_reads", "read_errors")}
        kind, key, slot, error = failures[0]
        action = "kept (read-only)" if self.read_only else "dropped" if kind != "read_errors" else "kept"
        log.error("%s: %d pages failed to read since the last report (so far: %d checksum mismatches, %d short "
                  "reads, %d read errors); e.g. key %s in slot %d: %s, %s", self.path, count,
                  totals["checksum_failures"], totals["short_reads"], totals["read_errors"], key.hex(), slot,
                  error or "checksum mismatch", action)

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
