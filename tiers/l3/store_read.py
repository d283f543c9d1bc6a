"""Reading from an L3Store (tiers/l3/store.py): the slots of a batch pinned, read in parallel and verified
against their key-bound checksums; a failure is a miss, counted, its entry dropped, and logged at most every
READ_FAILURE_LOG_S."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Sequence

import torch

from tiers.l3.entry import READ_FAILURE_LOG_S, TOUCH_FLUSH_ENTRIES
from tiers.l3.format import (
    bound_checksum,
)
from tiers.l3.store_state import StoreState

log = logging.getLogger("tiers.l3.store")  # one logger for the store, whichever part of it speaks


class StoreReads(StoreState):
    """L3Store's read methods (a mixin: the state they use is L3Store's)."""

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
