"""The simulated clock of a timed replay, and the byte movers that run on it.

A timed replay (hicache/replay/simulate.py) runs the server's scheduler and tier controller over metadata pools.
Nothing moves bytes, so every transfer is given the time it would take instead:
- `TimedCopier`: host <-> GPU copies, one copy engine per direction (PCIe is full duplex), each copy queued
  behind the earlier ones of its direction and taking pages x page bytes / bandwidth;
- `TimedWorker`: the L3 worker, one disk shared by reads and writes, reads first as `tiers.l3.worker` orders
  them (a write batch starts only while no read waits), each job taking its bytes / the read or write bandwidth.

A transfer's handle is done once the clock has reached its end, and waiting on it moves the clock there: the engine
thread would have blocked that long.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.replay.store import InlineWorker
from tiers.copy import COMPLETED, TransferHandle
from tiers.l3.worker import READ_PRIORITY_MAX_WAIT_S, Completion


class SimClock:
    """Seconds since the replay started; only the simulation moves it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.blocked_s = 0.0  # time the engine thread spent waiting on a transfer (`TimedTransfer.wait`)

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t

    def block_until(self, t: float) -> None:
        """The engine thread waits for something that ends at t."""
        if t > self.now:
            self.blocked_s += t - self.now
            self.now = t


class TimedTransfer:
    """A transfer that ends at `end` on the clock (tiers.copy.TransferHandle)."""

    __slots__ = ("clock", "end")

    def __init__(self, clock: SimClock, end: float):
        self.clock = clock
        self.end = end

    def done(self) -> bool:
        return self.clock.now >= self.end

    def wait(self) -> None:
        self.clock.block_until(self.end)


class TimedLayeredTransfer(TimedTransfer):
    """A host -> GPU copy that a forward may start under (tiers/layered_copy.py): the replay's step that reads it
    lasts at least until it lands (TimedReplay.run)."""

    __slots__ = ()
    streams = True
    failed = False

    def stream_wait_layer(self, layer: int, stream: Any = None) -> None:
        return None


class TimedCopier:
    """Host <-> GPU page copies that take their time (controller.ports.Copier); see the module doc. `layered`:
    loads stream in under the forward, as `cache.load_policy.layered` has them on CUDA."""

    def __init__(self, clock: SimClock, page_bytes: int, bytes_per_s: float | None, layered: bool = False):
        self.clock = clock
        self.layered = layered
        self.page_bytes = page_bytes
        self.bytes_per_s = bytes_per_s
        self._free_at = {"to_host": 0.0, "to_device": 0.0}
        self._ends: list[float] = []  # heap of the ends of copies not yet known to be done

    def _copy(self, direction: str, pages: int) -> TransferHandle:
        if not pages or not self.bytes_per_s or not self.page_bytes:
            return COMPLETED
        start = max(self.clock.now, self._free_at[direction])
        end = self._free_at[direction] = start + pages * self.page_bytes / self.bytes_per_s
        heapq.heappush(self._ends, end)
        if self.layered and direction == "to_device":
            return TimedLayeredTransfer(self.clock, end)
        return TimedTransfer(self.clock, end)

    def to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> TransferHandle:
        return self._copy("to_host", len(device_pages))

    def to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> TransferHandle:
        return self._copy("to_device", len(host_pages))

    def next_end(self) -> float | None:
        """When the next copy in flight ends (None: none is)."""
        ends, now = self._ends, self.clock.now
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        return ends[0] if ends else None


@dataclass
class _DiskJob:
    kind: str  # "read" or "write"
    pages: int
    submitted: float  # when it may start: submission, or (a write) when the host copy it stores has landed
    completion: Completion
    end: float = 0.0


class TimedWorker:
    """The L3 worker on the clock (controller.ports.Worker): the metadata store answers at once (an
    `InlineWorker`), and each answer is handed to the controller when the disk would have finished the job.

    `shared`: reads and writes take turns on one disk, reads first (a drive's bandwidth is shared); else each
    direction runs on its own (an L3 capped per direction, cache.l3.read_limit_gbps and write_limit_gbps, far below
    what the drive does), but a write batch still waits for reads to drain as the server's writer does (`_after_reads`):
    on an L3 capped at 1 GB/s, reads streamed by prefetch held writes back, pages waiting for the disk were dropped
    from the write queue, and host memory kept more of the sessions' prefixes than a replay without that wait
    predicted (bench/RESULTS.md, 'Replay predicts time')."""

    def __init__(self, clock: SimClock, store: Any, page_bytes: int, read_bytes_per_s: float | None,
                 write_bytes_per_s: float | None, queue_pages: int = 4096, batch_pages: int = 32,
                 shared: bool = True):
        self.clock = clock
        self.inner = InlineWorker(store)
        self.page_bytes = page_bytes
        self.bytes_per_s = {"read": read_bytes_per_s, "write": write_bytes_per_s}
        self.queue_pages = queue_pages
        self.batch_pages = batch_pages
        self.shared = shared
        self._queues: dict[str, deque[_DiskJob]] = {"read": deque(), "write": deque()}
        self._free_at = {"read": 0.0, "write": 0.0}  # when each channel finishes what it started (shared: "read")
        self._running: list[tuple[float, int, _DiskJob]] = []  # heap by end
        self._seq = 0
        self._queued_write_pages = 0  # submitted and not yet handed back
        self._write_since: float | None = None  # when the write batch next in line began to wait for reads
        self.busy_s = {"read": 0.0, "write": 0.0}  # disk time spent on each
        self.reads: list[tuple[float, int]] = []  # (start in ms, pages) of each read, for the bandwidth report

    refusal = "l3_queue_full"

    @property
    def queued_write_pages(self) -> int:
        return self._queued_write_pages

    def _job(self, kind: str, pages: int, ready: float) -> _DiskJob:
        done = self.inner.completions()
        assert len(done) == 1, "an inline worker answers each job as it is submitted"
        return _DiskJob(kind, pages, max(self.clock.now, ready), done[0])

    def submit_write(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any],
                     before: Callable[[], None] | None = None) -> bool:
        if self._queued_write_pages + len(keys) > self.queue_pages:
            return False
        # `before` waits for the GPU -> host copy that fills the pages: the disk cannot start before it ends
        ready = getattr(getattr(before, "__self__", None), "end", 0.0)
        self.inner.submit_write(token, keys, pages)
        self._queued_write_pages += len(keys)
        self._queues["write"].append(self._job("write", len(keys), ready))
        return True

    def submit_read(self, token: Any, keys: Sequence[bytes], pages: Sequence[Any]) -> None:
        self.inner.submit_read(token, keys, pages)
        self._queues["read"].append(self._job("read", len(keys), 0.0))

    def _start(self, batch: list[_DiskJob], t: float) -> float:
        """Run a batch from t on; returns when it ends."""
        for job in batch:
            bw = self.bytes_per_s[job.kind]
            seconds = job.pages * self.page_bytes / bw if bw and self.page_bytes else 0.0
            if job.kind == "read":
                self.reads.append((t * 1e3, job.pages))
            self.busy_s[job.kind] += seconds
            t += seconds
            job.end = t
            self._seq += 1
            heapq.heappush(self._running, (t, self._seq, job))
        return t

    def _run(self, now: float) -> None:
        """Start every job the disk takes up by `now`. Shared: at each moment the disk is free, the oldest read that
        has been submitted, else a batch of writes (up to batch_pages) that may start. Per direction: each queue
        in order on its own channel, a write batch after the reads in flight (`_after_reads`)."""
        kinds = ("read",) if self.shared else ("read", "write")
        for channel in kinds:
            queues = ["read", "write"] if self.shared else [channel]
            while any(self._queues[k] for k in queues):
                heads = {k: self._queues[k][0].submitted for k in queues if self._queues[k]}
                t = max(self._free_at[channel], min(heads.values()))
                if t > now:
                    break
                kind = next(k for k in queues if k in heads and heads[k] <= t)
                if not self.shared and kind == "write":
                    t = self._after_reads(t)
                    if t > now:
                        break
                    self._write_since = None  # this batch starts: the next one's wait begins when it is next in line
                queue = self._queues[kind]
                batch = [queue.popleft()]
                pages = batch[0].pages
                while kind == "write" and queue and queue[0].submitted <= t and \
                        pages + queue[0].pages <= self.batch_pages:
                    pages += queue[0].pages
                    batch.append(queue.popleft())
                self._free_at[channel] = self._start(batch, t)

    def _after_reads(self, t: float) -> float:
        """When a write batch ready at t starts on its own channel: the server's writer yields to reads, starting no
        batch while a read is queued or running, for at most READ_PRIORITY_MAX_WAIT_S (tiers/l3/worker.py). A later
        read may extend the wait; `_run` asks again at each event."""
        reads = self._queues["read"]
        if self._free_at["read"] <= t and not (reads and reads[0].submitted <= t):
            return t
        if self._write_since is None:
            self._write_since = t
        idle = self._free_at["read"] if not reads else float("inf")
        return min(self._write_since + READ_PRIORITY_MAX_WAIT_S, max(t, idle))

    def completions(self) -> list[Completion]:
        now = self.clock.now
        self._run(now)
        out = []
        while self._running and self._running[0][0] <= now:
            job = heapq.heappop(self._running)[2]
            if job.kind == "write":
                self._queued_write_pages -= job.pages
            out.append(job.completion)
        return out

    def next_end(self) -> float | None:
        """When the disk next hands back a job (None: nothing is in flight or queued)."""
        self._run(self.clock.now)
        # a write batch waiting for reads starts by the end of its wait at the latest
        gate = [self._write_since + READ_PRIORITY_MAX_WAIT_S] if self._write_since is not None else []
        if self._running:
            return min([self._running[0][0], *gate])
        heads = [q[0].submitted for q in self._queues.values() if q] + gate
        return min(heads) if heads else None  # queued behind a copy still landing: starts then

    def stage(self, pages: Sequence[Any]) -> list[Any] | None:
        return list(pages)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Move the clock to the end of everything submitted (the engine thread waits for the disk)."""
        self._run(float("inf"))
        if self._running:
            self.clock.block_until(max(end for end, _, _ in self._running))
        return True

    def close(self) -> None:
        self.inner.close()
