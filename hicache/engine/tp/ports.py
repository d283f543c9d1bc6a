"""The leader's byte stores as its controller sees them under tensor parallelism: each proxy makes a call on the
leader's own tier and records it as an op for the followers (hicache.engine.tp.lockstep), which make it on theirs.

What the controller decides (allocations, the tree, which keys to probe) stays on the leader; what moves or frees
bytes is sent: copies between GPU and host (`to_host`, `to_device`), L3 reads and writes (with the host page ids
their buffers are, since a buffer means nothing in another process), L3 deletes and admission sightings. Ops:

    ("to_host", device_pages, host_pages)    ("read", op, keys, host_pages)
    ("to_device", host_pages, device_pages)  ("write", op, keys, host_pages, staged)
    ("delete", keys)                         ("note_hit", keys)

`LockstepWorker` holds each read's and write's completion back from the controller until every rank has reported
it, with the per-page results ANDed: the controller acts on a page only once it has landed (or failed) everywhere,
so no rank's bytes are reused or read before they are there, and one rank's failed read is a failed read for all.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from tiers.l3.worker import Completion

logger = logging.getLogger(__name__)


def host_page_of(host: Any, buffer: Any) -> int:
    """The host page id a page buffer of the host pool (`page_view`) is, from its address."""
    base = host.page_view(0).data_ptr()
    offset = buffer.data_ptr() - base
    page, rest = divmod(offset, host.page_bytes)
    if rest or not 0 <= page < host.capacity_pages:
        raise ValueError(f"an L3 buffer at offset {offset} is not a page of the host pool "
                         f"({host.capacity_pages} pages of {host.page_bytes} bytes)")
    return page


class LockstepCopier:
    """The copier between the leader's pools; every copy is also an op."""

    def __init__(self, copier: Any, record: Callable[[tuple], None]) -> None:
        self.copier = copier
        self.record = record

    def __getattr__(self, name: str) -> Any:  # mode, staging, pools: the wrapped copier's
        return getattr(self.copier, name)

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int], after: Any = None) -> Any:
        return self._copy("to_host", device_pages, host_pages, after)

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int], after: Any = None) -> Any:
        return self._copy("to_device", host_pages, device_pages, after)

    def _copy(self, op: str, src: Sequence[int], dst: Sequence[int], after: Any) -> Any:
        """The wrapped copier's `op` (`after` passed only when given, as copiers without it take none), recorded."""
        copy = getattr(self.copier, op)
        handle = copy(src, dst) if after is None else copy(src, dst, after=after)
        if len(src):
            self.record((op, list(src), list(dst)))
        return handle

    def fence(self) -> Any:
        return self.copier.fence()


class LockstepL3:
    """The leader's L3 store: probes and counts are answered by it alone (its index decides, and a follower
    that lacks a page fails that read, which is then recomputed); deletes and admission sightings are ops."""

    def __init__(self, store: Any, record: Callable[[tuple], None]) -> None:
        self.store = store
        self.record = record
        if hasattr(store, "note_hit"):  # the controller looks for it: present only where the store has one
            self.note_hit = self._note_hit

    def __getattr__(self, name: str) -> Any:  # contains, used_pages, capacity_pages, shared_pages, stats
        return getattr(self.store, name)

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> Any:
        result = self.store.delete(keys, wait)
        if len(keys):
            self.record(("delete", list(keys)))
        return result

    def _note_hit(self, keys: Sequence[bytes]) -> None:
        self.store.note_hit(keys)
        self.record(("note_hit", list(keys)))


class LockstepWorker:
    """The leader's L3 worker; reads and writes are ops, and their completions wait for every rank (module doc).

    `exchange()` runs one plan exchange (the followers report only in one); `broken()` says whether the group
    is lost, after which missing reports count as failures so the leader can close its own tiers."""

    def __init__(self, worker: Any, host: Any, followers: Sequence[int], record: Callable[[tuple], None],
                 exchange: Callable[[], None], broken: Callable[[], bool], timeout_s: float) -> None:
        self.worker = worker
        self.host = host
        self.followers = list(followers)
        self.record = record
        self.exchange = exchange
        self.broken = broken
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self._tokens: dict[int, Any] = {}  # op id -> the controller's token, until released
        self._own: dict[int, Completion] = {}  # op id -> the leader's own completion
        self._reports: dict[int, dict[int, list[bool] | None]] = {}  # op id -> rank -> its results (None: lost)
        self._write_pages: dict[int, int] = {}  # op id of a write -> its pages, until released
        self._staged: tuple[list[int], list[int]] | None = None  # the last `stage`: (buffer ids, host pages)

    # ------------------------------------------------------------------ what the controller reads

    @property
    def queue_pages(self) -> int:
        return self.worker.queue_pages

    @property
    def refusal(self) -> str:
        return self.worker.refusal

    @property
    def queued_write_pages(self) -> int:
        """Pages of writes not yet released: a rank's queue holds a write until every rank has finished it."""
        return sum(self._write_pages.values())

    # ------------------------------------------------------------------ calls

    def stage(self, pages: Sequence[Any]) -> list[Any] | None:
        """The leader's staged copies; the followers stage theirs when they apply the write that uses them."""
        host_pages = [host_page_of(self.host, p) for p in pages]
        staged = self.worker.stage(pages)
        self._staged = None if staged is None else ([id(p) for p in staged], host_pages)
        return staged

    def submit_write(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any], before: Any = None) -> bool:
        n = len(keys)
        if self.queued_write_pages + n > self.queue_pages:
            return False
        staged = self._staged is not None and self._staged[0] == [id(p) for p in pages]
        host_pages = self._staged[1] if staged else [host_page_of(self.host, p) for p in pages]
        self._staged = None
        op = next(self._ids)
        if not self.worker.submit_write(op, keys, pages, before):
            return False
        self._submitted(op, token)
        self._write_pages[op] = n
        self.record(("write", op, list(keys), host_pages, staged))
        return True

    def submit_read(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any]) -> None:
        host_pages = [host_page_of(self.host, p) for p in pages]
        op = next(self._ids)
        self.worker.submit_read(op, keys, pages)
        self._submitted(op, token)
        self.record(("read", op, list(keys), host_pages))

    def _submitted(self, op: int, token: Any) -> None:
        self._tokens[op] = token
        self._reports[op] = {}

    # ------------------------------------------------------------------ completions

    def receive(self, rank: int, done: Sequence[tuple[int, list[bool]]]) -> None:
        """A follower's finished reads and writes (from its report)."""
        for op, results in done:
            reports = self._reports.get(op)
            if reports is None:
                raise RuntimeError(f"tensor-parallel rank {rank} reported I/O op {op}, which is not in flight")
            reports[rank] = list(results)

    def awaiting(self) -> bool:
        """Whether some read or write waits for a follower's report."""
        return any(len(reports) < len(self.followers) for reports in self._reports.values())

    def completions(self) -> list[Completion]:
        """The reads and writes every rank has finished, as one completion each (per-page results ANDed)."""
        for c in self.worker.completions():
            self._own[c.token] = c
        if self.broken():
            self._fail_missing()
        out = []
        for op in [op for op, c in self._own.items() if len(self._reports[op]) == len(self.followers)]:
            own = self._own.pop(op)
            ranks = self._reports.pop(op)
            self._write_pages.pop(op, None)
            results = [ok and all(r is not None and r[i] for r in ranks.values()) for i, ok in enumerate(own.results)]
            if results != own.results:
                lost = sorted(rank for rank, r in ranks.items() if r is None or not all(r))
                logger.warning("L3 %s of %d pages failed on tensor-parallel rank(s) %s: counted as failed on "
                               "every rank", own.kind, len(results), lost)
            out.append(dataclasses.replace(own, token=self._tokens.pop(op), results=results))
        return out

    def _fail_missing(self) -> None:
        """The group is lost: a report that has not come never will (None: failed, whatever its pages)."""
        for reports in self._reports.values():
            for rank in self.followers:
                reports.setdefault(rank, None)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every read and write has finished on every rank (exchanging plans to hear of them); False
        on timeout. Once the group is lost, the followers' missing reports count as failures."""
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        if not self.worker.wait_idle(timeout):
            return False
        while self.awaiting():
            if self.broken():
                self._fail_missing()
                break
            if time.monotonic() > deadline:
                return False
            try:
                self.exchange()
            except Exception:  # noqa: BLE001 - the group is lost (logged there): count what is missing as failed
                self._fail_missing()
                break
            if self.awaiting():
                time.sleep(0.001)
        return True

    def close(self) -> None:
        self.worker.close()
