"""The replay's L3 stand-in: an in-memory key index with the store's admission rule and a traffic log, and the
worker that calls it inline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiers.l3.admission import admission_policy
from tiers.l3.worker import Completion
from tiers.metadata_pool import MetadataL3


class ReplayL3(MetadataL3):
    """MetadataL3 that applies `admission_hits` like the real L3Store and counts disk traffic.

    Counts pages written (admitted and new), pages read, and written pages that were never read
    back before being deleted (`deleted_unread`) or by now (`unread_pages()`).
    """

    def __init__(self, capacity_pages: int, page_bytes: int = 0, admission_hits: int = 0):
        super().__init__(capacity_pages, page_bytes)
        self.admission = admission_policy(admission_hits)
        self.pages_written = 0
        self.pages_read = 0
        self.not_admitted = 0
        self.deleted_unread = 0
        self._unread: set[bytes] = set()  # written and not read since

    def write_pages(self, keys: Sequence[bytes], pages: Sequence[Any]) -> list[bool]:
        admitted = self.admission.admit(keys)
        stored = self._keys
        results = []
        for key, ok in zip(keys, admitted):
            if key in stored:
                results.append(True)
                continue
            if not ok:
                self.not_admitted += 1
                results.append(False)
                continue
            while len(stored) >= self.capacity_pages:  # the store's own cap (the controller keeps below it)
                old = next(iter(stored))
                del stored[old]
                self.evictions += 1
                self._forget(old)
            stored[key] = None
            self._unread.add(key)
            self.pages_written += 1
            results.append(True)
        self.admission.forget([k for k, ok in zip(keys, results) if ok])
        return results

    def read_pages(self, keys: Sequence[bytes], out: Sequence[Any]) -> list[bool]:
        results = [k in self._keys for k in keys]
        self.pages_read += sum(results)
        self._unread.difference_update(keys)
        return results

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> int:
        n = super().delete(keys)
        for key in keys:
            self._forget(key)
        return n

    def _forget(self, key: bytes) -> None:
        if key in self._unread:
            self._unread.discard(key)
            self.deleted_unread += 1

    def unread_pages(self) -> int:
        """Pages on disk now that were written and never read."""
        return len(self._unread)


class InlineWorker:
    """The L3 worker of a replay (controller.ports.Worker): each job runs on the caller's thread as it is submitted
    and its completion waits for the next `completions()`, as a worker thread's would. The store is an index in
    memory, so there is nothing to overlap, and no lock or queue to pay for per job."""

    refusal = "l3_queue_full"
    queued_write_pages = 0  # every write is done by the time it is queued

    def __init__(self, store: Any, queue_pages: int = 1 << 62):
        self.store = store
        self.queue_pages = queue_pages
        self._done: list[Completion] = []

    def submit_write(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any], before: Any = None) -> bool:
        results = self.store.write_pages(keys, pages)
        self._done.append(Completion("write", token, results, frozenset(keys), reasons=(None,) * len(results)))
        return True

    def submit_read(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any]) -> None:
        self._done.append(Completion("read", token, list(self.store.read_pages(keys, pages)), frozenset(keys)))

    def completions(self) -> list[Completion]:
        done, self._done = self._done, []
        return done

    def stage(self, pages: Sequence[Any]) -> list[Any] | None:
        return list(pages)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        return None
