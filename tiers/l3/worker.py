"""Asynchronous L3 I/O for the controller: a writer thread with a bounded queue and reader threads.

The controller never blocks on the disk. It submits writes (host pages -> L3) and reads
(L3 -> host pages); results come back as completions that the controller applies on its own
thread in `poll()`. When the write queue holds `queue_pages` pages, further writes are refused
instead of stalling compute; the controller keeps them waiting for room (controller/writes.py).

Reads come first: a request waits for them, while writes are background work. The writer starts no
new batch while reads are queued or running (for at most `READ_PRIORITY_MAX_WAIT_S` at a time, so a
steady stream of reads cannot starve it), so a disk busy with write-through traffic still serves
reads at close to its full speed. A read that a write batch ran beside all the same (it came while the batch ran)
says so (`Completion.shared`): its time measures the two sharing the disk, not the disk's read speed.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

READ_PRIORITY_MAX_WAIT_S = 1.0  # longest a write batch waits for reads to drain


@dataclass
class Completion:
    kind: str  # "write" or "read"
    token: Any  # the caller's tag
    results: list[bool]  # per page: written / read and verified
    keys: frozenset[bytes] = frozenset()
    seconds: float = 0.0  # time the store call took (reads: for the controller's bandwidth estimate)
    end: float = 0.0  # time.monotonic() when it finished: concurrent reads overlap, [end - seconds, end] each
    reasons: tuple[str | None, ...] = ()  # writes: why each refused page was refused, where the store says
    shared: bool = False  # reads: a write batch ran during some of it (its time is not the disk's read speed)


@dataclass
class _ReadJob:
    token: Any
    keys: list[bytes]
    pages: list[Any]  # page buffers (1-D uint8 tensors)
    nbytes: int = 0  # the pages' bytes, where reads are batched (read_batch_bytes)


@dataclass
class _WriteJob:
    token: Any
    keys: list[bytes]
    pages: list[Any]  # page buffers (1-D uint8 tensors)
    before: Callable[[], None] | None  # e.g. wait for the GPU->host copy that fills the pages


class L3Worker:
    """Runs L3 store calls off the controller's thread; `synchronous=True` runs them inline (tests, replay)."""

    def __init__(self, store: Any, threads: int = 2, queue_pages: int = 4096, batch_pages: int = 32,
                 synchronous: bool = False, on_complete: Callable[[Completion], None] | None = None,
                 read_batch_bytes: int = 0):
        """on_complete: called with each completion on the I/O thread that finished it, instead of queuing it for
        `completions` (callers that each wait for their own job: hicache/integrations/chunks.py).

        read_batch_bytes: a reader thread that finds several reads queued serves them in one store call of up to
        this many bytes (0: one call per read). A store call costs tens of microseconds of Python before its
        copies start, as much as copying a 2 MiB chunk from tmpfs takes one core; callers that submit one small
        read per job (vLLM's load jobs of a chunk each) then spend a third of the time in it. Each read still
        completes on its own, at the end of its batch."""
        self.store = store
        self.read_batch_bytes = read_batch_bytes
        self.read_threads = max(1, threads)
        self._reads: collections.deque[_ReadJob] = collections.deque()
        self.on_complete = on_complete
        self.queue_pages = queue_pages
        self.batch_pages = batch_pages
        self.synchronous = synchronous
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._queued_pages = 0
        self._outstanding = 0
        self._reads_active = 0  # reads queued or running
        self._writing = False  # a write batch is running
        self._writing_now = False  # a caller's write runs on its own thread (`write_now`)
        self._write_ended = 0.0  # time.monotonic() when the last write batch ended
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._writes: queue.Queue[_WriteJob | None] = queue.Queue()
        self._closed = False
        if not synchronous:
            self._reader = ThreadPoolExecutor(self.read_threads, thread_name_prefix="hicache-l3-read")
            self._writer = threading.Thread(target=self._write_loop, name="hicache-l3-write", daemon=True)
            self._writer.start()

    refusal = "l3_queue_full"  # why `submit_write` refuses a write: its queue is full

    @property
    def queued_write_pages(self) -> int:
        return self._queued_pages

    def submit_write(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any],
                     before: Callable[[], None] | None = None) -> bool:
        """Queue a write of pages under keys; False (nothing queued) when the queue is full."""
        job = _WriteJob(token, list(keys), list(pages), before)
        with self._lock:
            if self._closed:
                return False
            if self._queued_pages + len(keys) > self.queue_pages:
                return False
            self._queued_pages += len(keys)
            self._outstanding += 1
        if self.synchronous:
            self._run_writes([job])
        else:
            self._writes.put(job)
        return True

    def submit_read(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any]) -> None:
        """Read keys into page buffers; the completion says which pages were read and verified."""
        with self._lock:
            self._outstanding += 1
            self._reads_active += 1
        pages = list(pages)
        nbytes = sum(int(getattr(p, "nbytes", 0)) for p in pages) if self.read_batch_bytes else 0
        job = _ReadJob(token, list(keys), pages, nbytes)
        if self.synchronous:
            self._run_reads([job])
        else:
            self._reads.append(job)
            self._reader.submit(self._take_reads)

    def write_now(self, keys: Sequence[bytes],
                  pages: Sequence[Any]) -> tuple[list[bool], list[str | None]] | None:
        """Write pages on the calling thread, for a caller that would only wait for the writer: per page, True where
        stored (or already present), and why not where the store says (as a write's `Completion.reasons`). None,
        with nothing written, while another write is queued or running: submit it instead, so that concurrent
        callers still share the writer's synced batches. Like the writer, it first yields to the reads in
        progress."""
        with self._lock:
            if self._closed or self._queued_pages or self._writing_now:
                return None
            self._writing_now = True
        try:
            self._yield_to_reads()
            return self._store_write(list(keys), list(pages))
        finally:
            with self._idle:
                self._writing_now = False
                self._idle.notify_all()

    def read_now(self, keys: Sequence[bytes], pages: Sequence[Any]) -> list[bool]:
        """Read keys into page buffers on the calling thread, for a caller that would only wait for a queued read:
        it saves the hand-offs to a reader thread and back. It counts as a read in progress, so the writer
        yields to it as to queued reads. True where read and verified."""
        with self._lock:
            self._reads_active += 1
        try:
            return list(self.store.read_pages(list(keys), list(pages)))
        except Exception:
            logger.exception("L3 read of %d pages failed", len(keys))
            return [False] * len(keys)
        finally:
            with self._idle:
                self._reads_active -= 1
                self._idle.notify_all()

    def completions(self) -> list[Completion]:
        """Completions that arrived since the last call."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def wait_completions(self, timeout: float | None = None) -> list[Completion]:
        """`completions`, but block up to `timeout` for the first one (an L3 process forwards them as they come)."""
        try:
            first = self._done.get(timeout=timeout)
        except queue.Empty:
            return []
        return [first, *self.completions()]

    def stage(self, pages: Sequence[Any]) -> list[Any] | None:
        """Copies of page buffers that a write can own, so that their host pages may be freed at once (a write
        of pages leaving the host tier)."""
        return [p.clone() if hasattr(p, "clone") else p for p in pages]

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has completed; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    def close(self) -> None:
        """Finish queued work, then stop the threads."""
        with self._idle:
            self._closed = True
            self._idle.wait_for(lambda: not self._writing_now)  # a caller's write in progress (`write_now`)
        if not self.synchronous:
            self._writes.put(None)
            self._writer.join()
            self._reader.shutdown(wait=True)

    # ------------------------------------------------------------------ worker side

    def _finish(self, completion: Completion, pages: int = 0) -> None:
        if self.on_complete is not None:
            self.on_complete(completion)
        else:
            self._done.put(completion)
        with self._idle:
            self._queued_pages -= pages
            self._outstanding -= 1
            if completion.kind == "read":
                self._reads_active -= 1
            self._idle.notify_all()

    def _yield_to_reads(self) -> None:
        """Wait (bounded) until no read is queued or running."""
        with self._idle:
            self._idle.wait_for(lambda: self._reads_active == 0 or self._closed, READ_PRIORITY_MAX_WAIT_S)

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            if job is None:
                return
            batch = [job]
            pages = len(job.keys)
            while pages < self.batch_pages:  # group queued jobs into one synced batch
                try:
                    nxt = self._writes.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._writes.put(None)
                    break
                batch.append(nxt)
                pages += len(nxt.keys)
            self._yield_to_reads()
            self._run_writes(batch)

    def _run_writes(self, batch: list[_WriteJob]) -> None:
        keys: list[bytes] = []
        pages: list[Any] = []
        for job in batch:
            if job.before is not None:
                job.before()
            keys.extend(job.keys)
            pages.extend(job.pages)
        start = time.perf_counter()
        results, reasons = self._store_write(keys, pages)
        end = self._write_ended
        elapsed = time.perf_counter() - start
        i = 0
        for job in batch:
            n = len(job.keys)
            self._finish(Completion("write", job.token, results[i : i + n], frozenset(job.keys), elapsed, end,
                                    reasons=tuple(reasons[i : i + n])), n)
            i += n

    def _store_write(self, keys: list[bytes], pages: list[Any]) -> tuple[list[bool], list[str | None]]:
        """One store write call: per page, whether stored, and why not where the store says."""
        detailed = getattr(self.store, "write_pages_detailed", None)  # L3Store: with the reasons of refusals
        self._writing = True
        try:
            if detailed is not None:
                results, reasons = detailed(keys, pages)
                return list(results), list(reasons)
            return list(self.store.write_pages(keys, pages)), [None] * len(keys)
        except Exception:  # the store reports I/O faults as False; anything else is a bug, keep serving
            logger.exception("L3 write of %d pages failed", len(keys))
            return [False] * len(keys), [None] * len(keys)
        finally:
            self._write_ended = time.monotonic()
            self._writing = False

    def _take_reads(self) -> None:
        """Serve the oldest queued read, with the reads queued behind it up to `read_batch_bytes`, and up to this
        thread's share of the queue, so that a short queue still spreads over the reader threads (one task per
        submitted read: a task that finds the queue emptied by others' batches has nothing to do)."""
        batch: list[_ReadJob] = []
        nbytes = 0
        share = max(1, -(-len(self._reads) // self.read_threads)) if self.read_batch_bytes else 1
        while len(batch) < share:
            try:
                job = self._reads.popleft()
            except IndexError:
                break
            batch.append(job)
            nbytes += job.nbytes
            try:
                following = self._reads[0]  # another thread may take it first: the batch then ends a job longer
            except IndexError:
                break
            if nbytes + following.nbytes > self.read_batch_bytes:
                break
        if batch:
            self._run_reads(batch)

    def _run_reads(self, batch: list[_ReadJob]) -> None:
        keys = [k for job in batch for k in job.keys]
        pages = [p for job in batch for p in job.pages]
        start = time.perf_counter()
        began = time.monotonic()
        shared = self._writing
        try:
            results = list(self.store.read_pages(keys, pages))
        except Exception:
            logger.exception("L3 read of %d pages failed", len(keys))
            results = [False] * len(keys)
        end = time.monotonic()
        seconds = time.perf_counter() - start
        shared = shared or self._writing or self._write_ended > began
        i = 0
        for job in batch:  # each over the batch's interval: concurrent reads' bytes count over their union
            n = len(job.keys)
            self._finish(Completion("read", job.token, results[i:i + n], frozenset(job.keys), seconds, end,
                                    shared=shared))
            i += n
