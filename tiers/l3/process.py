"""The L3 store in a process of its own, reading and writing the host pool in place through shared memory.

Why a process: threads of one interpreter share its lock. Beside a busy engine thread the L3's I/O threads ran at a
fraction of their speed at Python's 5 ms switch interval, and a shorter interval taxed the engine thread instead
(bench/RESULTS.md, 'L3 beside a busy engine thread'). A process has a lock of its own: its threads do the I/O, the
checksums and the index commits, and the engine thread only exchanges small messages with it.

The main process keeps the host pool in a memfd (`HostPool(shared=True)`), pinned for the GPU copies as before,
and a second memfd of staging pages for writes whose host pages leave at once (`stage`). `L3Process` starts
`python -m tiers.l3.process_child`, hands it both descriptors and two socket pairs, and gives:

- `store`: the L3 as the controller, the server and the calibration use it (`contains`, `used_pages`,
  `delete`, `note_hit`, `write_pages`, `read_pages`, `stats`, ...): calls answered in order over one connection.
  `delete(wait=False)` sends without waiting for the answer, and is still applied before any later probe.
- `worker`: `tiers.l3.worker.L3Worker`'s interface over the other connection. Writes and reads go as page
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
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from tiers.l3.format import L3Error
from tiers.l3.process_child import CLOSE_TIMEOUT_S, Pages, map_shared
from tiers.l3.process_proxies import CallTimes, ChildLink, CurrentLink, StoreProxy, WorkerProxy
from tiers.persistent import remote_name

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the child imports torch and opens (perhaps creates) the store
RESTART_MAX_S = 60.0  # longest wait between attempts to restart a dead L3 process


class L3Process:
    """Start the L3 store in a process of its own; `store` and `worker` are its two faces."""

    def __init__(self, host: Any, store_args: dict[str, Any] | None, threads: int, queue_pages: int, batch_pages: int,
                 staging_pages: int | None = None, remote_args: dict[str, Any] | None = None, remote_pages: int = 0,
                 restart: bool = True, restart_min_s: float = 1.0) -> None:
        """store_args: the local L3 store's (`L3Store`'s arguments), remote_args the remote tier's
        (`tiers.remote.RemoteStore`'s); either may be None (tiers/persistent.py). `restart`: a child that dies is
        replaced, after `restart_min_s` and then a doubling backoff up to RESTART_MAX_S."""
        self._staging_fd: int | None = None
        if getattr(host, "share_fd", None) is None:
            raise ValueError("the L3 process needs a host pool in shared memory (HostPool(shared=True))")
        page_bytes = host.page_bytes
        if store_args is None and remote_args is None:
            raise ValueError("the L3 process needs a local store, a remote tier, or both")
        self.path = (os.path.abspath(os.fspath(store_args["path"])) if store_args is not None
                     else remote_name(remote_args["url"]) if remote_args is not None else "")
        staging_pages = queue_pages if staging_pages is None else staging_pages
        self.restart, self.restart_min_s = restart, restart_min_s
        self.closing = False
        self.restarts = 0
        self.call_times = CallTimes()  # over every child this one starts
        self._restarting = threading.Lock()
        staging_fd = self._staging_fd = os.memfd_create("hicache-l3-staging", os.MFD_CLOEXEC)  # kept for restarts
        try:
            os.ftruncate(self._staging_fd, staging_pages * page_bytes)  # sparse: memory is used as slots are
            staging = map_shared(self._staging_fd, staging_pages * page_bytes).view(-1, page_bytes)
            pool = host.buffer.view(host.capacity_pages, -1).view(torch.uint8)
            self._pages = Pages(pool, staging, page_bytes)
            stores = {"store": store_args, "remote": remote_args, "remote_pages": remote_pages}
            self._launch: Callable[[], ChildLink] = lambda: self._start(host, staging_fd, staging_pages, threads,
                                                                        batch_pages, stores)
            link, value = self._open()
        except BaseException:
            self.release()
            raise
        self.current = CurrentLink(link)
        self.store = StoreProxy(self, self._pages, value)
        self.worker = WorkerProxy(self.current, self._pages, queue_pages)
        self._watch(link)
        logger.info("%s: L3 store open in process %d, %d pages, io_backend=%s", self.path, link.proc.pid,
                    self.store.capacity_pages, self.store.io_backend)

    def _open(self) -> tuple[ChildLink, dict[str, Any]]:
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

    def _watch(self, link: ChildLink) -> None:
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
               stores: dict[str, Any]) -> ChildLink:
        parent_async, child_async = socket.socketpair()
        parent_rpc, child_rpc = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        fds = (child_async.fileno(), child_rpc.fileno(), host.share_fd, staging_fd)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "tiers.l3.process_child", str(fds[0]), str(fds[1])],
                                    pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        finally:
            child_async.close()
            child_rpc.close()
        link = ChildLink(proc, Connection(parent_async.detach()), Connection(parent_rpc.detach()), self.path,
                     self.call_times)
        spec = {"pool_fd": host.share_fd, "pool_pages": host.capacity_pages, "page_bytes": host.page_bytes,
                "staging_fd": staging_fd, "staging_pages": staging_pages, **stores, "threads": threads,
                "batch_pages": batch_pages, "log_level": logging.getLogger().getEffectiveLevel()}
        link.rpc_conn.send(spec)
        return link

    @staticmethod
    def _first_answer(link: ChildLink) -> tuple[str, Any]:
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
