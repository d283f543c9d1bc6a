"""Writing to an L3Store (tiers/l3/store.py): a batch is planned (admission, present keys, free slots or LRU
eviction), its pages written in parallel, made durable together (one fdatasync and one index commit per group of
`sync_batch_pages`) and only then recorded, so that a crash never leaves an index entry over unwritten bytes."""

from __future__ import annotations

import errno
import heapq
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tiers.l3.entry import Entry
from tiers.l3.format import (
    IndexRecord,
    L3Error,
    bound_checksum,
    index_key,
)
from tiers.l3.store_state import StoreState

log = logging.getLogger("tiers.l3.store")  # one logger for the store, whichever part of it speaks


class StoreWrites(StoreState):
    """L3Store's write methods (a mixin: the state they use is L3Store's)."""

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

    def _write_planned(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], todo: list[int],
                       results: list[bool]) -> None:
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

    def _check_writable(self) -> None:
        if self.read_only:
            raise L3Error(errno.EROFS, f"{self.path}: L3 store opened read-only")
        if self._index is None:
            raise L3Error(errno.EBADF, f"{self.path}: L3 store is closed")

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
            victims: list[tuple[bytes, int]] = []
            if len(slots) < len(keys):
                for key, entry in self._entries.items():
                    if len(slots) + len(victims) == len(keys):
                        break
                    if entry.slot not in self._pins and key not in protect:
                        victims.append((key, entry.slot))
                for key, _ in victims:
                    del self._entries[key]  # its slot is now in flight to the writer
                self._counters["evictions"] += len(victims)
                if self._evicted is not None:
                    self._evicted.extend(key for key, _ in victims)
            slots += [slot for _, slot in victims]
            slots.sort()
            for key, slot in zip(keys, slots):
                self._in_flight[key] = slot
            return victims, slots

    def _sync_and_finish(self, keys: Sequence[bytes], group: list[int], slots: list[int], outcomes: Any,
                         results: list[bool]) -> None:
        """Sync one written group and commit its index entries (none once an earlier group degraded the store)."""
        digests: list[int | None] = [None] * len(group) if self._state == "degraded" else self._sync_group(outcomes)
        self._finish_writes(keys, group, slots, digests, results)

    def _sync_group(self, outcomes: Any) -> list[int | None]:
        """fdatasync a written group; returns each page's checksum, None where the write or sync failed."""
        digests = [o.digest if o.error is None else None for o in outcomes]
        failed = [o.error for o in outcomes if o.error is not None]
        if failed:
            self._degrade(f"write failed for {len(failed)} pages: {failed[0]}", len(failed))
        if any(d is not None for d in digests):
            try:
                self._open_slab.sync()
                with self._lock:
                    self._counters["fsyncs"] += 1
            except OSError as e:
                self._degrade(f"fdatasync failed: {e}", sum(d is not None for d in digests))
                digests = [None] * len(digests)
        return digests

    def _finish_writes(self, keys: Sequence[bytes], group: list[int], slots: list[int], digests: list[int | None],
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
                    self._entries[keys[i]] = Entry(slot, d, t)
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
