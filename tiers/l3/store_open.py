"""Opening an L3Store (tiers/l3/store.py): the directory and its writer lock, the slab header checked against
the store's settings, the index opened (moved aside if damaged, a missing one reported), and the entries loaded
into memory with their slots; recovery from a crash is this: whatever the index committed is what the store
holds."""

from __future__ import annotations

import errno
import logging
import os
import time

from tiers.l3.entry import Entry
from tiers.l3.format import (
    FORMAT_VERSION,
    KEY_BYTES,
    NAMESPACE_BYTES,
    IndexRecord,
    L3Error,
    SlabHeader,
    VersionMismatch,
    slot_bytes_for,
)
from tiers.l3.identity import allocated_slots, namespace_difference, write_namespace_fields
from tiers.l3.index import INDEX_NAME, index_map_bytes, move_aside, open_index
from tiers.l3.io import KvikioSlotIO, PosixSlotIO, kvikio_compat_mode, kvikio_usable
from tiers.l3.lockfile import WriterLock, prepare_directory
from tiers.l3.slab import SlabFile, create_slab, read_header, slab_path
from tiers.l3.store_state import StoreState

log = logging.getLogger("tiers.l3.store")  # one logger for the store, whichever part of it speaks


class StoreOpening(StoreState):
    """L3Store's open methods (a mixin: the state they use is L3Store's)."""

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
        self._header = self._open_slab.header
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
        header = self._open_slab.header
        on_disk = self._open_slab.slots_on_disk()
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
                self._open_slab.resize(slot_count)
            else:
                self._open_slab.ensure_size()
        records.sort(key=lambda item: item[1].last_access_ns)
        self._last_stamp = records[-1][1].last_access_ns if records else 0
        for key, record in records:
            self._entries[key] = Entry(record.slot, record.checksum, record.last_access_ns)
        self._free = [slot for slot in range(self._open_slab.header.slot_count) if slot not in used]
