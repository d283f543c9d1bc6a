"""The L3 process's own side (tiers/l3/process.py starts it as `python -m tiers.l3.process_child`): it maps the
host pool and the staging pages the parent shares, opens the store, runs an L3Worker over it, answers store calls
on one connection and forwards the worker's completions on the other."""

from __future__ import annotations

import logging
import mmap
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from tiers.l3.worker import L3Worker

logger = logging.getLogger(__name__)

FORWARD_POLL_S = 0.05  # the completion forwarder wakes this often when idle, to notice shutdown
CLOSE_TIMEOUT_S = 60.0  # the child finishes queued writes and flushes the index


def map_shared(fd: int, nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor over `nbytes` of the memfd `fd`, shared."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


class Pages:
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


def _child(spec: dict[str, Any], async_conn: Connection, rpc_conn: Connection) -> int:
    from tiers.persistent import open_persistent

    page_bytes = spec["page_bytes"]
    pool = map_shared(spec["pool_fd"], spec["pool_pages"] * page_bytes).view(-1, page_bytes)
    staging = map_shared(spec["staging_fd"], spec["staging_pages"] * page_bytes).view(-1, page_bytes)
    pages = Pages(pool, staging, page_bytes)
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
                conn.send(("done", [(c.kind, c.token, c.results, c.seconds, c.end, c.reasons, c.shared)
                                    for c in batch]))
            except OSError:
                return
        elif done.is_set():
            return


_STORE_CALLS = ("contains", "used_pages", "keys", "stats", "flush", "check_integrity", "note_hit", "shared_pages")


def _answer(store: Any, pages: Pages, conn: Connection) -> None:
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
    """Entry of `python -m tiers.l3.process ASYNC_FD RPC_FD`; the spec is the first message on RPC_FD."""
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


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
