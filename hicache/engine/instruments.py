"""Instruments of the engine step: timers, the JSON step log and the GPU profiler window.

`Engine.step` calls the same hooks on every instrument at fixed points of a step:

    begin -> planned(plan) -> [forward_begin -> forward_queued -> sampling -> sampled] -> end(plan, first_tokens)

(the bracketed part only when the plan is not empty). `StepTimes` is always installed and keeps the
engine's timing counters; the step log and the profiler are added on demand and read them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hicache.gc_stats import GcTimer

logger = logging.getLogger(__name__)

Plan = Sequence[tuple[Any, int]]  # (request, new tokens) per sequence of the step


class Instrument:
    """The hooks of one engine step (see the module doc); each does nothing here."""

    def begin(self) -> None: ...

    def planned(self, plan: Plan) -> None: ...

    def forward_begin(self) -> None: ...

    def forward_queued(self) -> None: ...

    def sampling(self) -> None: ...

    def sampled(self) -> None: ...

    def end(self, plan: Plan, first_tokens: int) -> None: ...

    def close(self) -> None: ...


class Instruments(Instrument):
    """Several instruments as one, called in the order they were added."""

    def __init__(self, *items: Instrument):
        self.items = list(items)

    def add(self, item: Instrument) -> None:
        self.items.append(item)

    def remove(self, item: Instrument) -> None:
        self.items.remove(item)

    def begin(self) -> None:
        for i in self.items:
            i.begin()

    def planned(self, plan: Plan) -> None:
        for i in self.items:
            i.planned(plan)

    def forward_begin(self) -> None:
        for i in self.items:
            i.forward_begin()

    def forward_queued(self) -> None:
        for i in self.items:
            i.forward_queued()

    def sampling(self) -> None:
        for i in self.items:
            i.sampling()

    def sampled(self) -> None:
        for i in self.items:
            i.sampled()

    def end(self, plan: Plan, first_tokens: int) -> None:
        for i in self.items:
            i.end(plan, first_tokens)

    def close(self) -> None:
        for i in self.items:
            i.close()


class StepTimes(Instrument):
    """The engine's counters: steps and tokens, and where a step's wall time goes.

    `schedule_s` is scheduling and committing, including `overlapped_s`, the part that ran after the forward
    was queued (next-step admission, launching loads: the GPU is busy meanwhile). `forward_s` is queueing the
    forward and waiting for its sampled tokens. `enqueue` is the last step's (wall, engine-thread CPU) seconds
    spent queueing its forward: less CPU than wall time means the thread waited, for the GIL or for a core.
    """

    def __init__(self, counters: dict[str, Any]):
        self.counters = counters
        self.enqueue = (0.0, 0.0)
        self._t = 0.0
        self._own = 0.0  # this step's scheduling, less what overlapped its forward
        self._forward = (0.0, 0.0)

    def _lap(self) -> float:
        now = time.perf_counter()
        lap, self._t = now - self._t, now
        return lap

    def _schedule(self) -> None:
        lap = self._lap()
        self.counters["schedule_s"] += lap
        self._own += lap

    def begin(self) -> None:
        self._t = self._begin = time.perf_counter()
        self._own = 0.0

    def planned(self, plan: Plan) -> None:
        self._schedule()

    def forward_begin(self) -> None:
        self._schedule()  # the stream waits for the plan's copies
        self._forward = (self._t, time.thread_time())

    def forward_queued(self) -> None:
        lap = self._lap()
        self.counters["forward_s"] += lap
        self.enqueue = (lap, time.thread_time() - self._forward[1])

    def sampling(self) -> None:
        lap = self._lap()
        self.counters["schedule_s"] += lap
        self.counters["overlapped_s"] += lap

    def sampled(self) -> None:
        self.counters["forward_s"] += self._lap()

    def end(self, plan: Plan, first_tokens: int) -> None:
        c = self.counters
        self._schedule()  # commits
        if not plan:
            return
        c["steps"] += 1
        decodes = 0
        for req, n in plan:
            decode = n == 1 and req.num_output
            decodes += bool(decode)
            c["decode_tokens" if decode else "prefill_tokens"] += n
        if decodes < len(plan):
            c["prefill_steps"] += 1
            c["prefill_schedule_s"] += self._own
        else:  # a decode-only step: its wall time against its batch (server/metrics.py fits them)
            seconds = time.perf_counter() - self._begin
            c["decode_steps"] += 1
            c["decode_step_s"] += seconds
            c["decode_step_seqs"] += decodes
            c["decode_step_seqs2"] += decodes * decodes
            c["decode_step_seq_s"] += decodes * seconds



class StepLog(Instrument):
    """One JSON line per forward step: when it ran, how long scheduling and the forward took, the tokens and
    sequences in it, the queues and GPU pages in use after it. What the aggregate counters cannot show: which
    steps are decode-only, where the engine waits, how admission moves.

    On CUDA each line also has the GPU's view of the step, from events on the compute stream: `wait_ms`, how long
    the stream waited for the copies the step's requests needed, and `gpu_ms`, from the forward's first kernel
    to its last (including any time the GPU idled because the CPU queued kernels more slowly than it ran them:
    compare with `enqueue_ms`, the wall time spent queueing the forward, and `enqueue_cpu_ms`, the engine thread's
    CPU time in it). `gc_ms` is the time Python's garbage collector ran during the step, on any thread (it holds
    the GIL). A line is written once its events complete, so logging never makes the engine wait for the GPU.
    """

    def __init__(self, path: str, times: StepTimes, queues: Callable[[], dict[str, int]],
                 gauges: Callable[[], dict[str, int]], cuda: bool):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - kept open until close()
        self.times = times
        self.queues = queues  # the scheduler's queue lengths
        self.gauges = gauges  # the cache's device_used_pages and backup_waits counter
        self.cuda = cuda
        self.gc = GcTimer().install()
        self._start = self._last = time.monotonic()
        self._before: dict[str, Any] = {}
        self._events: tuple[torch.cuda.Event, ...] | None = None
        # lines waiting for their GPU timing events (CUDA): written in order once the events complete
        self.pending: list[tuple[dict[str, Any], tuple[torch.cuda.Event, ...] | None]] = []

    def begin(self) -> None:
        self._before = dict(self.times.counters, backup_waits=self.gauges()["backup_waits"], gc_s=self.gc.total)
        self._events = None

    def planned(self, plan: Plan) -> None:
        if plan and self.cuda:
            self._events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            self._events[0].record()  # before the stream waits for the plan's copies

    def forward_begin(self) -> None:
        if self._events is not None:
            self._events[1].record()

    def forward_queued(self) -> None:
        if self._events is not None:
            self._events[2].record()

    def end(self, plan: Plan, first_tokens: int) -> None:
        if not plan:
            return
        now = time.monotonic()
        c, b = self.times.counters, self._before
        ms = lambda key: (c[key] - b[key]) * 1e3  # noqa: E731
        gauges = self.gauges()
        line = {
            "t": round(now - self._start, 6),
            "gap_ms": round((now - self._last) * 1e3 - ms("schedule_s") - ms("forward_s"), 3),
            "schedule_ms": round(ms("schedule_s"), 3),
            "overlapped_ms": round(ms("overlapped_s"), 3),
            "forward_ms": round(ms("forward_s"), 3),
            "enqueue_ms": round(self.times.enqueue[0] * 1e3, 3),
            "enqueue_cpu_ms": round(self.times.enqueue[1] * 1e3, 3),
            "gc_ms": round((self.gc.total - b["gc_s"]) * 1e3, 3),
            "sequences": len(plan),
            "prefill_tokens": c["prefill_tokens"] - b["prefill_tokens"],
            "decode_tokens": c["decode_tokens"] - b["decode_tokens"],
            "graph": c["graph_steps"] > b["graph_steps"],
            "first_tokens": first_tokens,
            **self.queues(),
            "device_used_pages": gauges["device_used_pages"],  # cached and in use, of the pool's capacity
            # pages freed this step whose copy to host was still in flight: the next forward waits for those copies
            "backup_wait_pages": gauges["backup_waits"] - b["backup_waits"],
        }
        self._last = now
        self.pending.append((line, self._events))
        self.flush()

    def flush(self, wait: bool = False) -> None:
        """Write the pending lines whose GPU events completed (all of them, waiting, if `wait`), in order."""
        pending = self.pending
        while pending:
            line, events = pending[0]
            if events is not None:
                if not wait and not events[-1].query():
                    return
                events[-1].synchronize()
                before_waits, start, end = events
                line["wait_ms"] = round(before_waits.elapsed_time(start), 3)
                line["gpu_ms"] = round(start.elapsed_time(end), 3)
            self.file.write(json.dumps(line) + "\n")
            pending.pop(0)

    def close(self) -> None:
        self.flush(wait=True)
        self.file.close()
        self.gc.remove()


class GpuTrace(Instrument):
    """Records forward steps [first, first + steps) (counted from 0) with torch's profiler: a Chrome trace at
    `path` (open it in Perfetto or chrome://tracing; each step is a range named `step N`) and a table of the
    busiest kernels at `path` + ".txt". For finding where a step's GPU time goes; it slows the traced steps a
    little. `done` once written."""

    def __init__(self, path: str, first: int, steps: int, counters: dict[str, Any], cuda: bool):
        if first < 0 or steps < 1:
            raise ValueError(f"trace_gpu: first_step must be >= 0 and steps >= 1 (got {first}, {steps})")
        self.path, self.first, self.last = path, first, first + steps
        self.counters = counters
        self.cuda = cuda
        self.profiler: Any = None
        self._range: Any = None
        self.done = False

    def begin(self) -> None:
        n = self.counters["steps"]
        if self.done or not self.first <= n < self.last:
            return
        if self.profiler is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            logger.info("GPU trace: recording steps %d-%d", self.first, self.last - 1)
        self._range = torch.profiler.record_function(f"step {n}")
        self._range.__enter__()

    def end(self, plan: Plan, first_tokens: int) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.profiler is not None and self.counters["steps"] >= self.last:
            self._write()

    def _write(self) -> None:
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(self.path)
        sort = "cuda_time_total" if self.cuda else "cpu_time_total"
        with open(self.path + ".txt", "w") as f:
            f.write(profiler.key_averages().table(sort_by=sort, row_limit=60) + "\n")
        self.done = True
        logger.info("GPU trace written to %s (and %s.txt)", self.path, self.path)

    def close(self) -> None:
        if self.profiler is not None:  # the window is cut short: write what was recorded
            self._write()
