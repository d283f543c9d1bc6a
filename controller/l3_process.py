"""The L3 store in a process of its own, reading and writing the host pool in place through shared memory.

Why a process: threads of one interpreter share its lock. Beside a busy engine thread the L3's I/O threads ran at
0.27 of their speed at Python's 5 ms switch interval, and a shorter interval taxed the engine thread 51% instead
(bench/RESULTS.md, 'L3 beside a busy engine thread'). A process has a lock of its own: its threads do the I/O, the
checksums and the index commits, and the engine thread only exchanges small messages with it.

The main process keeps the host pool in a memfd (`HostPool(shared=True)`), pinned for the GPU copies as before,
and a second memfd of staging pages for writes whose host pages leave at once (`stage`). `L3Process` starts
`python -m controller.l3_process`, hands it both descriptors and two socket pairs, and gives:

- `store`: the L3 as the controller, the server and the calibration use it (`contains`, `used_pages`,
  `delete`, `note_hit`, `write_pages`, `read_pages`, `stats`, ...): calls answered in order over one connection.
  `delete(wait=False)` sends without waiting for the answer, and is still applied before any later probe.
- `worker`: `controller.l3_io.L3Worker`'s interface over the other connection. Writes and reads go as page
  references (a host page id, or -1 - a staging slot); completions come back as messages that the engine thread
  reads in `completions()` without blocking. A write that must wait for its GPU -> host copy (`before`) is sent
  by a forwarding thread once the copy is done.

If the process goes away (killed, crashed), the L3 is gone until another one is started, loudly and without harm:
one ERROR line, the reads in flight fail (their requests recompute), writes are refused and counted as `l3_gone`,
probes miss. A new process is started in the background (after 1 s, then a doubling backoff up to a minute); it
reopens the store, whose committed pages survived, and the tier is back (one WARNING line).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from controller.l3_io import Completion, L3Worker
from tiers.l3.format import L3Error
from tiers.persistent import remote_name

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the child imports torch and opens (perhaps creates) the store
CLOSE_TIMEOUT_S = 60.0  # the child finishes queued writes and flushes the index
RESTART_MAX_S = 60.0  # longest wait between attempts to restart a dead L3 process
FORWARD_POLL_S = 0.05  # the child's completion forwarder wakes this often when idle, to notice shutdown
SLOW_CALL_S = 0.25  # a store call answered slower than this is logged (at most once per SLOW_CALL_LOG_S)
SLOW_CALL_LOG_S = 10.0


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor over `nbytes` of the memfd `fd`, shared."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


class _Pages:
    """Page references <-> page buffers: host page i is `pool[i]`, staging slot s is `staging[s]` (ref -1 - s)."""

    def __init__(self, pool: torch.Tensor, staging: torch.Tensor, page_bytes: int) -> None:
        self.pool, self.staging, self.page_bytes = pool, staging, page_bytes
        self._spans = [(pool.data_ptr(), pool.shape[0], 1), (staging.data_ptr(), staging.shape[0], -1)]

    def buffer(self, ref: int) -> torch.Tensor:
        return self.pool[ref] if ref >= 0 else self.staging[-1 - ref]

    def ref(self, page: Any) -> int:
        """The reference of a page buffer, which must be a whole page of the pool or of the staging area."""
        ptr = page.data_ptr()
        for base, count, sign in self._spans:
            offset = ptr - base
            if 0 <= offset < count * self.page_bytes and page.numel() == self.page_bytes:
                index, rest = divmod(offset, self.page_bytes)
                if rest == 0:
                    return index if sign > 0 else -1 - index
        raise ValueError("an L3 page buffer outside the shared host pool and staging area: the L3 process cannot "
                         "reach it")


# ---------------------------------------------------------------------------------------------- the child


def _describe(e: BaseException) -> tuple[str, int | None, str]:
    return type(e).__name__, getattr(e, "errno", None), str(e)


def _child(spec: dict, async_conn: Connection, rpc_conn: Connection) -> int:
    from tiers.persistent import open_persistent

    page_bytes = spec["page_bytes"]
    pool = _map(spec["pool_fd"], spec["pool_pages"] * page_bytes).view(-1, page_bytes)
    staging = _map(spec["staging_fd"], spec["staging_pages"] * page_bytes).view(-1, page_bytes)
    pages = _Pages(pool, staging, page_bytes)
    try:
        store = open_persistent(spec["store"], spec["remote"], spec["remote_pages"])
    except Exception as e:  # noqa: BLE001 - every failure to open goes back to the parent, which raises it
        rpc_conn.send(("err", _describe(e)))
        return 1
    # the parent counts queued pages against its queue_pages: the worker here never refuses
    worker = L3Worker(store, threads=spec["threads"], queue_pages=sys.maxsize, batch_pages=spec["batch_pages"])
    rpc_conn.send(("ok", {"capacity_pages": store.capacity_pages, "io_backend": store.io_backend,
                          "shared": hasattr(store, "shared_pages")}))
    done = threading.Event()
    forwarder = threading.Thread(target=_forward, args=(worker, async_conn, done), name="l3-forward", daemon=True)
    forwarder.start()
    answering = threading.Thread(target=_answer, args=(store, pages, rpc_conn), name="l3-rpc", daemon=True)
    answering.start()
    try:
        while True:
            try:
                message = async_conn.recv()
            except (EOFError, OSError):
                break  # the parent went away: finish what is queued and close the store
            op = message[0]
            if op == "write":
                worker.submit_write(message[1], message[2], [pages.buffer(r) for r in message[3]])
            elif op == "read":
                worker.submit_read(message[1], message[2], [pages.buffer(r) for r in message[3]])
            elif op == "note":
                store.note_hit(message[1])
            elif op == "close":
                break
    finally:
        worker.close()
        done.set()
        forwarder.join()
        try:
            async_conn.send(("closed",))
        except OSError:
            pass
        answering.join(CLOSE_TIMEOUT_S)  # the parent's close call, or its going away, ends it
        store.close()
    return 0


def _forward(worker: L3Worker, conn: Connection, done: threading.Event) -> None:
    """Send completions to the parent as they arrive, in batches."""
    while True:
        batch = worker.wait_completions(FORWARD_POLL_S)
        if batch:
            try:
                conn.send(("done", [(c.kind, c.token, c.results, c.seconds, c.end, c.reasons) for c in batch]))
            except OSError:
                return
        elif done.is_set():
            return


_STORE_CALLS = ("contains", "used_pages", "keys", "stats", "flush", "check_integrity", "note_hit", "shared_pages")


def _answer(store: Any, pages: _Pages, conn: Connection) -> None:
    """Serve the parent's store calls, in order, until it closes the store or goes away."""
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        if method == "delete_nowait":  # no answer: the parent does not wait
            try:
                store.delete(args[0], wait=False)
            except Exception:  # noqa: BLE001
                logger.exception("L3 delete of %d keys failed", len(args[0]))
            continue
        try:
            if method == "close":
                conn.send(("ok", None))
                return
            if method == "delete":
                value = store.delete(args[0], wait=True)
            elif method == "write_pages":
                value = store.write_pages(args[0], [pages.buffer(r) for r in args[1]])
            elif method == "discard":
                value = store.discard(args[0])
            elif method == "read_pages":
                value = store.read_pages(args[0], [pages.buffer(r) for r in args[1]])
            elif method in _STORE_CALLS:
                value = getattr(store, method)(*args)
            else:
                raise ValueError(f"unknown L3 call {method!r}")
            reply = ("ok", value)
        except Exception as e:  # noqa: BLE001 - the parent re-raises it
            reply = ("err", _describe(e))
        try:
            conn.send(reply)
        except OSError:
            return


def child_main(argv: Sequence[str]) -> int:
    """Entry of `python -m controller.l3_process ASYNC_FD RPC_FD`; the spec is the first message on RPC_FD."""
    async_conn, rpc_conn = Connection(int(argv[0])), Connection(int(argv[1]))
    spec = rpc_conn.recv()
    logging.basicConfig(level=spec.get("log_level", logging.INFO),
                        format="%(asctime)s %(levelname)s l3-process %(name)s: %(message)s")
    try:
        return _child(spec, async_conn, rpc_conn)
    except Exception:  # noqa: BLE001
        logger.exception("the L3 process failed")
        return 1


# ---------------------------------------------------------------------------------------------- the parent


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

    def snapshot(self) -> dict:
        return {"call_seconds": self.seconds, "calls": self.calls, "slowest_call_s": self.slowest_s}


class _Link:
    """The parent's ends of both connections, the child, and whether it is gone."""

    def __init__(self, proc: subprocess.Popen, async_conn: Connection, rpc_conn: Connection, path: str,
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

    def send(self, message: tuple) -> bool:
        if self.gone is not None:
            return False
        with self.send_lock:
            try:
                self.async_conn.send(message)
                return True
            except OSError as e:
                self.lost(f"send: {e}")
                return False


class _Current:
    """The link to the L3 process now running (a restart swaps it)."""

    def __init__(self, link: _Link) -> None:
        self.link = link


class RemoteStore:
    """The L3 store of the child process, as `tiers.l3.L3Store` is called by the controller, the server and the
    calibration."""

    def __init__(self, owner: L3Process, pages: _Pages, info: dict) -> None:
        self._owner, self._pages = owner, pages
        self.capacity_pages: int = info["capacity_pages"]
        self._io_backend: str = info["io_backend"]
        self.page_bytes = pages.page_bytes
        self.path = owner.path
        if info.get("shared"):  # a shared tier behind it: hits it serves are told apart (tiers/persistent.py)
            self.shared_pages = self._shared_pages

    @property
    def _link(self) -> _Link:
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

    def stats(self) -> dict:
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


class RemoteWorker:
    """`L3Worker`'s interface to the child's worker: the controller submits and polls as it does in-process."""

    def __init__(self, current: _Current, pages: _Pages, queue_pages: int) -> None:
        self._current, self._pages = current, pages
        self.queue_pages = queue_pages
        self._queued = 0
        self._jobs: dict[int, _Job] = {}
        self._next_id = 0
        self._inbox: list[Completion] = []
        self._staging_free = list(range(pages.staging.shape[0] - 1, -1, -1))
        self._forwards: queue.SimpleQueue = queue.SimpleQueue()
        self._forwarding = 0  # writes waiting in the forwarder (everything queues behind them, to keep order)
        self._lock = threading.Lock()
        self._closed = False
        self._forwarder = threading.Thread(target=self._forward_loop, name="hicache-l3-forward", daemon=True)
        self._forwarder.start()

    @property
    def _link(self) -> _Link:
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
        """Finish queued work and stop the child's worker (the store closes with `RemoteStore.close`)."""
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

    def _dispatch(self, message: tuple, before: Callable[[], None] | None) -> None:
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

    def _complete(self, items: list[tuple]) -> None:
        with self._lock:
            for kind, job_id, results, seconds, end, reasons in items:
                job = self._jobs.pop(job_id, None)
                if job is None:
                    continue
                if kind == "write":
                    self._queued -= len(job.keys)
                    self._staging_free.extend(job.staged)
                self._inbox.append(Completion(kind, job.token, list(results), frozenset(job.keys), seconds, end,
                                              tuple(reasons)))

    def _fail_all(self) -> None:
        """The child is gone: every job in flight completes as failed."""
        with self._lock:
            pending = list(self._jobs)
            items = [(self._jobs[j].kind, j, [False] * len(self._jobs[j].keys), 0.0, time.monotonic(),
                      ("gone",) * len(self._jobs[j].keys) if self._jobs[j].kind == "write" else ())
                     for j in pending]
        self._complete(items)


class L3Process:
    """Start the L3 store in a process of its own; `store` and `worker` are its two faces."""

    def __init__(self, host: Any, store_args: dict | None, threads: int, queue_pages: int, batch_pages: int,
                 staging_pages: int | None = None, remote_args: dict | None = None, remote_pages: int = 0,
                 restart: bool = True, restart_min_s: float = 1.0) -> None:
        """store_args: the local L3 store's (`L3Store`'s arguments), remote_args the shared tier's
        (`tiers.remote.RemoteStore`'s); either may be None (tiers/persistent.py). `restart`: a child that dies is
        replaced, after `restart_min_s` and then a doubling backoff up to RESTART_MAX_S."""
        self._staging_fd: int | None = None
        if getattr(host, "share_fd", None) is None:
            raise ValueError("the L3 process needs a host pool in shared memory (HostPool(shared=True))")
        page_bytes = host.page_bytes
        self.path = (os.path.abspath(os.fspath(store_args["path"])) if store_args is not None
                     else remote_name(remote_args["url"]))
        staging_pages = queue_pages if staging_pages is None else staging_pages
        self.restart, self.restart_min_s = restart, restart_min_s
        self.closing = False
        self.restarts = 0
        self.call_times = CallTimes()  # over every child this one starts
        self._restarting = threading.Lock()
        self._staging_fd = os.memfd_create("hicache-l3-staging", os.MFD_CLOEXEC)  # kept for a restarted child
        try:
            os.ftruncate(self._staging_fd, staging_pages * page_bytes)  # sparse: memory is used as slots are
            staging = _map(self._staging_fd, staging_pages * page_bytes).view(-1, page_bytes)
            pool = host.buffer.view(host.capacity_pages, -1).view(torch.uint8)
            self._pages = _Pages(pool, staging, page_bytes)
            self._launch = lambda: self._start(host, self._staging_fd, staging_pages, threads, batch_pages,
                                               {"store": store_args, "remote": remote_args,
                                                "remote_pages": remote_pages})
            link, value = self._open()
        except BaseException:
            self.release()
            raise
        self.current = _Current(link)
        self.store = RemoteStore(self, self._pages, value)
        self.worker = RemoteWorker(self.current, self._pages, queue_pages)
        self._watch(link)
        logger.info("%s: L3 store open in process %d, %d pages, io_backend=%s", self.path, link.proc.pid,
                    self.store.capacity_pages, self.store.io_backend)

    def _open(self) -> tuple[_Link, dict]:
        """Start a child and wait until its store is open; L3Error with the child's reason if it fails."""
        link = self._launch()
        status, value = self._first_answer(link)
        if status == "err":
            link.proc.wait(CLOSE_TIMEOUT_S)
            for conn in (link.async_conn, link.rpc_conn):
                conn.close()
            name, code, message = value
            raise L3Error(code or errno.EIO, message if name == "L3Error" else f"{self.path}: {name}: {message}")
        return link, value

    def _watch(self, link: _Link) -> None:
        link.on_gone += [self.worker._fail_all, self._restart_later]

    def _restart_later(self) -> None:
        """The child is gone: start another in the background, with a backoff, unless the store is closing."""
        if self.restart and not self.closing and self._restarting.acquire(blocking=False):
            threading.Thread(target=self._restart_loop, name="hicache-l3-restart", daemon=True).start()

    def _restart_loop(self) -> None:
        delay = self.restart_min_s
        try:
            while not self.closing:
                time.sleep(delay)
                if self.closing:
                    return
                try:
                    link, _ = self._open()
                except OSError as e:
                    logger.error("%s: restarting the L3 process failed (%s); next try in %.0f s", self.path, e,
                                 min(RESTART_MAX_S, delay * 2))
                    delay = min(RESTART_MAX_S, delay * 2)
                    continue
                self._watch(link)
                self.current.link = link
                self.restarts += 1
                logger.warning("%s: the L3 process is back (process %d, restart %d): the disk tier is on again",
                               self.path, link.proc.pid, self.restarts)
                return
        finally:
            self._restarting.release()

    def release(self) -> None:
        """Close what the parent keeps for restarts (the staging descriptor)."""
        if self._staging_fd is not None:
            os.close(self._staging_fd)
            self._staging_fd = None

    def _start(self, host: Any, staging_fd: int, staging_pages: int, threads: int, batch_pages: int,
               stores: dict) -> _Link:
        parent_async, child_async = socket.socketpair()
        parent_rpc, child_rpc = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        fds = (child_async.fileno(), child_rpc.fileno(), host.share_fd, staging_fd)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "controller.l3_process", str(fds[0]), str(fds[1])],
                                    pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        finally:
            child_async.close()
            child_rpc.close()
        link = _Link(proc, Connection(parent_async.detach()), Connection(parent_rpc.detach()), self.path,
                     self.call_times)
        spec = {"pool_fd": host.share_fd, "pool_pages": host.capacity_pages, "page_bytes": host.page_bytes,
                "staging_fd": staging_fd, "staging_pages": staging_pages, **stores, "threads": threads,
                "batch_pages": batch_pages, "log_level": logging.getLogger().getEffectiveLevel()}
        link.rpc_conn.send(spec)
        return link

    @staticmethod
    def _first_answer(link: _Link) -> tuple[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if link.rpc_conn.poll(0.2):
                    return link.rpc_conn.recv()
            except (EOFError, OSError):
                break
            if link.proc.poll() is not None:
                break
        if link.proc.poll() is None:
            link.proc.kill()
        code = link.proc.wait()
        return "err", ("RuntimeError", None, f"the L3 process exited (status {code}) before opening the store")


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
