"""Python's garbage collector in a long-running server: freeze what startup built, time every collection.

A full (generation 2) collection walks every tracked object in the process, and the collector holds the GIL while it
does, so the engine thread stops with it. On the H200 one such collection stopped a multi-turn run for a long step
(bench/RESULTS.md, 'Cold start, power cap and GC pauses'), most of it spent on objects that live as
long as the process: modules, the model, the server. `freeze_startup` moves those out of the collector's reach once
startup is done (`gc.freeze`), so later collections walk only what serving allocates. `GcTimer` adds up how long
collections take, for the step log and for /metrics.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class GcTimer:
    """A `gc.callbacks` hook: total seconds and the longest single collection, on whichever thread ran it.

    `install` adds it to `gc.callbacks`, `remove` takes it out."""

    def __init__(self) -> None:
        self.total = 0.0
        self.longest = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start:
            pause = time.perf_counter() - self._start
            self.total += pause
            self.longest = max(self.longest, pause)
            self._start = 0.0

    def install(self) -> GcTimer:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


_process_timer: GcTimer | None = None


def process_timer() -> GcTimer:
    """The process-wide timer behind the server's GC metrics, installed on first use (serve installs it once startup
    is frozen: the freeze's own full collection, ~0.15 s for the 8B server's ~330k objects, is not a serving pause)."""
    global _process_timer
    if _process_timer is None:
        _process_timer = GcTimer().install()
    return _process_timer


def freeze_startup() -> int:
    """Collect once, then move every object alive now into the collector's permanent generation (`gc.freeze`):
    later collections skip them. Call when startup is done; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("moved %d objects built at startup out of garbage collection (gc.freeze)", frozen)
    return frozen


def snapshot() -> dict[str, Any]:
    """Collections per generation, seconds spent collecting (once `process_timer` runs), the longest one, and the
    frozen object count."""
    timer = _process_timer
    return {
        "collections": [g["collections"] for g in gc.get_stats()],
        "seconds": timer.total if timer else 0.0,
        "longest_s": timer.longest if timer else 0.0,
        "frozen": gc.get_freeze_count(),
    }
