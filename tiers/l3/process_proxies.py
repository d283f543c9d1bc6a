"""The parent's side of the L3 process's two connections (tiers/l3/process.py): `StoreProxy`, the store's calls
answered in order over one connection, and `WorkerProxy`, the L3 worker's interface over the other, whose
completions the engine thread reads without blocking. `ChildLink` is one child's connections; `CurrentLink` the link
in use, replaced when a child is restarted."""

from __future__ import annotations

import errno
import logging
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from tiers.l3.format import L3Error
from tiers.l3.process_child import CLOSE_TIMEOUT_S, Pages
from tiers.l3.worker import Completion

logger = logging.getLogger(__name__)

SLOW_CALL_S = 0.25  # a store call answered slower than this is logged (at most once per SLOW_CALL_LOG_S)
SLOW_CALL_LOG_S = 10.0


class CallTimes:
    """How long callers (the engine thread) waited for the child's answers to store calls, over every child of
    one L3Process: a slow answer stalls an engine step, so it is counted, and logged when it is very slow."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.slowest_s = 0.0
        self._logged_at = -SLOW_CALL_LOG_S

    def add(self, path: str, method: str, seconds: float) -> None:
        """One answered call (under the link's call lock)."""
        self.seconds += seconds
        self.calls += 1
        self.slowest_s = max(self.slowest_s, seconds)
        now = time.monotonic()
        if seconds >= SLOW_CALL_S and now - self._logged_at >= SLOW_CALL_LOG_S:
            self._logged_at = now
            logger.warning("%s: the L3 process took %.2f s to answer %s (the caller waited; logged at most every "
                           "%.0f s)", path, seconds, method, SLOW_CALL_LOG_S)

    def snapshot(self) -> dict[str, Any]:
        return {"call_seconds": self.seconds, "calls": self.calls, "slowest_call_s": self.slowest_s}


class ChildLink:
    """The parent's ends of both connections, the child, and whether it is gone."""

    def __init__(self, proc: subprocess.Popen[bytes], async_conn: Connection, rpc_conn: Connection, path: str,
                 times: CallTimes | None = None) -> None:
        self.proc, self.async_conn, self.rpc_conn, self.path = proc, async_conn, rpc_conn, path
        self.times = times if times is not None else CallTimes()
        self.rpc_lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.gone: str | None = None
        self.on_gone: list[Callable[[], None]] = []

    def lost(self, why: str) -> None:
        if self.gone is not None:
            return
        code = self.proc.poll()
        self.gone = why if code is None else f"{why} (exit status {code})"
        logger.error("%s: the L3 process is gone (%s): the disk tier is off for the rest of this run; reads in "
                     "flight fail and recompute, writes are refused (counted as l3_gone); what it stored stays on "
                     "disk for the next start", self.path, self.gone)
        for callback in self.on_gone:
            callback()

    def call(self, method: str, *args: Any, default: Any = None, reply: bool = True) -> Any:
        """A store call in the child; `default` once it is gone. Errors it raised there are raised here."""
        if self.gone is not None:
            return default
        with self.rpc_lock:
            start = time.perf_counter()
            try:
                self.rpc_conn.send((method, args))
                if not reply:
                    return None
                status, value = self.rpc_conn.recv()
            except (EOFError, OSError) as e:
                self.lost(f"{method}: {e or type(e).__name__}")
                return default
            self.times.add(self.path, method, time.perf_counter() - start)
        if status == "err":
            name, code, message = value
            if name == "L3Error" or code is not None:
                raise L3Error(code or errno.EIO, message)
            raise RuntimeError(f"L3 process: {name}: {message}")
        return value

    def send(self, message: tuple[Any, ...]) -> bool:
        if self.gone is not None:
            return False
        with self.send_lock:
            try:
                self.async_conn.send(message)
                return True
            except OSError as e:
                self.lost(f"send: {e}")
                return False


class CurrentLink:
    """The link to the L3 process now running (a restart swaps it)."""

    def __init__(self, link: ChildLink) -> None:
        self.link = link


class ProcessOwner(Protocol):
    """What the store proxy needs of the L3Process that owns it (tiers/l3/process.py)."""

    path: str
    current: CurrentLink
    restarts: int
    call_times: CallTimes
    closing: bool

    def release(self) -> None: ...


class StoreProxy:
    """The L3 store of the child process, as `tiers.l3.L3Store` is called by the controller, the server and the
    calibration."""

    def __init__(self, owner: ProcessOwner, pages: Pages, info: dict[str, Any]) -> None:
        self._owner, self._pages = owner, pages
        self.capacity_pages: int = info["capacity_pages"]
        self._io_backend: str = info["io_backend"]
        self.page_bytes = pages.page_bytes
        self.path = owner.path
        if info.get("shared"):  # a remote tier behind it: hits it serves are told apart (tiers/persistent.py)
            self.shared_pages = self._shared_pages

    @property
    def _link(self) -> ChildLink:
        return self._owner.current.link

    @property
    def io_backend(self) -> str:
        return self._io_backend

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self._link.call("contains", list(keys), default=[False] * len(keys))

    def used_pages(self) -> int:
        return self._link.call("used_pages", default=0)

    def keys(self) -> list[bytes]:
        return self._link.call("keys", default=[])

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> int | None:
        if not wait:
            return self._link.call("delete_nowait", list(keys), reply=False)
        return self._link.call("delete", list(keys), default=0)

    def _shared_pages(self, keys: Sequence[bytes]) -> int:
        return self._link.call("shared_pages", list(keys), default=0)

    def discard(self, keys: Sequence[bytes]) -> int:
        return self._link.call("discard", list(keys), default=0)

    def note_hit(self, keys: Sequence[bytes]) -> None:
        self._link.send(("note", list(keys)))  # ordered before the write it precedes

    def write_pages(self, keys: Sequence[bytes], pages: Sequence[Any]) -> list[bool]:
        return self._link.call("write_pages", list(keys), [self._pages.ref(p) for p in pages],
                               default=[False] * len(keys))

    def read_pages(self, keys: Sequence[bytes], pages: Sequence[Any]) -> list[bool]:
        return self._link.call("read_pages", list(keys), [self._pages.ref(p) for p in pages],
                               default=[False] * len(keys))

    def flush(self) -> None:
        self._link.call("flush")

    def check_integrity(self) -> None:
        self._link.call("check_integrity")

    def stats(self) -> dict[str, Any]:
        gone = {"path": self.path, "state": "gone", "io_backend": self._io_backend, "pages": 0,
                "capacity_pages": self.capacity_pages}
        out = self._link.call("stats", default=gone)
        return {**out, "process": self._link.proc.pid, "restarts": self._owner.restarts,
                **self._owner.call_times.snapshot()}

    def close(self) -> None:
        """Close the store in the child and wait for it to exit (no restart from now on). Idempotent."""
        self._owner.closing = True
        link = self._link
        if link.proc.poll() is None and link.gone is None:
            link.send(("close",))  # the child's worker finishes what is queued
            link.call("close")
            link.gone = "closed"
        try:
            link.proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.error("%s: the L3 process did not exit in %.0f s; killing it", self.path, CLOSE_TIMEOUT_S)
            link.proc.kill()
            link.proc.wait()
        for conn in (link.async_conn, link.rpc_conn):
            conn.close()
        self._owner.release()


@dataclass
class _Job:
    token: Any
    kind: str
    keys: list[bytes]
    staged: list[int]  # staging slots this write owns


class WorkerProxy:
    """`L3Worker`'s interface to the child's worker: the controller submits and polls as it does in-process."""

    def __init__(self, current: CurrentLink, pages: Pages, queue_pages: int) -> None:
        self._current, self._pages = current, pages
        self.queue_pages = queue_pages
        self._queued = 0
        self._jobs: dict[int, _Job] = {}
        self._next_id = 0
        self._inbox: list[Completion] = []
        self._staging_free = list(range(pages.staging.shape[0] - 1, -1, -1))
        self._forwards: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._forwarding = 0  # writes waiting in the forwarder (everything queues behind them, to keep order)
        self._lock = threading.Lock()
        self._closed = False
        self._forwarder = threading.Thread(target=self._forward_loop, name="hicache-l3-forward", daemon=True)
        self._forwarder.start()

    @property
    def _link(self) -> ChildLink:
        return self._current.link

    @property
    def queued_write_pages(self) -> int:
        return self._queued

    @property
    def refusal(self) -> str:
        """Why a refused write was refused (the controller counts its pages under it)."""
        return "l3_gone" if self._link.gone is not None and not self._closed else "l3_queue_full"

    def stage(self, pages: Sequence[Any]) -> list[Any] | None:
        """Copies of the pages in staging slots, which the write owns; None when the slots are taken."""
        with self._lock:
            if len(self._staging_free) < len(pages) or self._link.gone is not None:
                return None
            slots = [self._staging_free.pop() for _ in pages]
        out = []
        for slot, page in zip(slots, pages):
            view = self._pages.staging[slot]
            view.copy_(page)
            out.append(view)
        return out

    def submit_write(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any],
                     before: Callable[[], None] | None = None) -> bool:
        refs = [self._pages.ref(p) for p in pages]
        staged = [-1 - r for r in refs if r < 0]
        with self._lock:
            if self._closed or self._link.gone is not None or self._queued + len(keys) > self.queue_pages:
                self._staging_free.extend(staged)
                return False
            self._queued += len(keys)
            job_id = self._add(_Job(token, "write", list(keys), staged))
        self._dispatch(("write", job_id, list(keys), refs), before)
        return True

    def submit_read(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any]) -> None:
        refs = [self._pages.ref(p) for p in pages]
        with self._lock:
            job_id = self._add(_Job(token, "read", list(keys), []))
        if self._link.gone is not None:
            self._fail_all()
            return
        self._dispatch(("read", job_id, list(keys), refs), None)

    def completions(self) -> list[Completion]:
        if not self._jobs and not self._inbox:
            return []  # nothing in flight: skip the pipe's poll, a system call that hands the GIL to other threads
        self._receive(0)
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._jobs:
                    return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._receive(1.0 if left is None else min(left, 1.0))

    def close(self) -> None:
        """Finish queued work and stop the child's worker (the store closes with `StoreProxy.close`)."""
        self.wait_idle(CLOSE_TIMEOUT_S)
        with self._lock:
            self._closed = True
        self._forwards.put(None)
        self._forwarder.join()

    # ---- internals ----

    def _add(self, job: _Job) -> int:
        job_id = self._next_id
        self._next_id += 1
        self._jobs[job_id] = job
        return job_id

    def _dispatch(self, message: tuple[Any, ...], before: Callable[[], None] | None) -> None:
        with self._lock:
            direct = before is None and self._forwarding == 0
            if not direct:
                self._forwarding += 1
        if direct:
            self._link.send(message)
        else:
            self._forwards.put((message, before))

    def _forward_loop(self) -> None:
        """Send writes once the copies that fill their pages are done, in submission order."""
        while True:
            item = self._forwards.get()
            if item is None:
                return
            message, before = item
            try:
                if before is not None:
                    before()
            except Exception:  # noqa: BLE001 - a failed copy: the pages hold nothing worth writing
                logger.exception("the copy before an L3 write failed; the write is dropped")
                self._complete([(message[0], message[1], [False] * len(message[2]), 0.0, time.monotonic(),
                                 ("failed",) * len(message[2]))])
            else:
                self._link.send(message)
            with self._lock:
                self._forwarding -= 1

    def _receive(self, timeout: float) -> None:
        """Read what the child sent, waiting up to `timeout` for the first message."""
        conn = self._link.async_conn
        if self._link.gone is not None:
            return
        try:
            ready = conn.poll(timeout)
            while ready:
                message = conn.recv()
                if message[0] == "done":
                    self._complete(message[1])
                ready = conn.poll(0)
        except (EOFError, OSError) as e:
            self._link.lost(f"receive: {e or type(e).__name__}")

    def _complete(self, items: list[tuple[Any, ...]]) -> None:
        with self._lock:
            for kind, job_id, results, seconds, end, reasons, shared in items:
                job = self._jobs.pop(job_id, None)
                if job is None:
                    continue
                if kind == "write":
                    self._queued -= len(job.keys)
                    self._staging_free.extend(job.staged)
                self._inbox.append(Completion(kind, job.token, list(results), frozenset(job.keys), seconds, end,
                                              tuple(reasons), shared))

    def _fail_all(self) -> None:
        """The child is gone: every job in flight completes as failed."""
        with self._lock:
            pending = list(self._jobs)
            items = [(self._jobs[j].kind, j, [False] * len(self._jobs[j].keys), 0.0, time.monotonic(),
                      ("gone",) * len(self._jobs[j].keys) if self._jobs[j].kind == "write" else (), False)
                     for j in pending]
        self._complete(items)
