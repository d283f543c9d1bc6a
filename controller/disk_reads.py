"""The L3 read queue as the controller sees it: when a read submitted now should land, how much is queued ahead,
and the disk's read bandwidth measured from the reads serving makes (controller/loads.py prices loads with it)."""

from __future__ import annotations

from collections.abc import Callable

READ_ESTIMATE_HALF_LIFE_S = 5.0  # how fast the disk bandwidth estimate forgets old reads


class DiskReads:
    """Landing estimates for queued reads and a decayed bandwidth estimate; `clock` is the caller's (tests and the
    replay replace it)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.free_at = 0.0  # when the read queue drains, by the estimate
        self._busy_until = 0.0  # end of the last read interval seen (see `observe`)
        self._window: tuple[float, float, float | None] = (0.0, 0.0, None)  # decayed bytes, busy s, last end

    def eta(self, nbytes: int, bytes_per_s: float | None) -> float:
        """When a read of `nbytes` submitted now should land: reads queue behind each other on the disk (an unknown
        bandwidth counts as free)."""
        start = max(self.clock(), self.free_at)
        self.free_at = start + (nbytes / bytes_per_s if bytes_per_s else 0.0)
        return self.free_at

    def ahead(self) -> float:
        """Seconds of reads queued ahead of one submitted now, by the estimate."""
        return max(0.0, self.free_at - self.clock())

    def observe(self, nbytes: int, seconds: float, end: float, current: float | None) -> float | None:
        """Fold a measured read into the bandwidth estimate (`current`: the figure it refines); returns the new
        estimate in bytes/s, or None where there is none yet.

        Reads run side by side on the worker's reader threads, so one read's own time overstates what its bytes
        cost: 4 reads in flight each take about 4x as long. The estimate is bytes over the time the disk had
        reads in flight (the union of the reads' [end - seconds, end] intervals), both sums decayed with a
        half-life of READ_ESTIMATE_HALF_LIFE_S; the calibrated figure starts it as one second's worth.
        """
        start = max(end - seconds, self._busy_until)
        busy = max(0.0, end - start)
        b, t, last = self._window
        if last is None:
            b, t, last = (current, 1.0, end - seconds) if current else (0.0, 0.0, end)
        decay = 0.5 ** (max(0.0, end - last) / READ_ESTIMATE_HALF_LIFE_S)
        b, t = b * decay + nbytes, t * decay + busy
        self._window = (b, t, max(last, end))
        self._busy_until = max(self._busy_until, end)
        return b / t if t > 0 else None
