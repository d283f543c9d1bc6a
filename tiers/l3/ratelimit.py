"""A token bucket that paces a store's reads or writes to a set bandwidth (`cache.l3.read_limit_gbps`, ...).

What it is for: emulating an NVMe of a given speed on a faster device (tmpfs), so that "from which storage speed
does the L3 pay" can be measured on one machine, and keeping one server's share of a disk that several share.

A call takes its bytes before its I/O. The bucket holds at most `burst_s` seconds of bandwidth; a call larger
than what is in it runs the balance negative and sleeps until the balance is back at zero, so concurrent callers
queue behind each other's debt and the long-run rate is the limit whatever the call sizes. Sleeping happens
outside the lock, in the caller's thread (an I/O thread of the store, never the engine thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

DEFAULT_BURST_S = 0.02  # bandwidth the bucket may bank while idle: a 20 ms spike, not a free second


class TokenBucket:
    """Paces callers to `bytes_per_s` (0 or None: unlimited, `take` returns at once). `clock` and `sleep` are
    injectable so that tests check the pacing without depending on the machine's timing."""

    def __init__(self, bytes_per_s: float | None, burst_s: float = DEFAULT_BURST_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if bytes_per_s is not None and bytes_per_s < 0:
            raise ValueError(f"rate limit must be >= 0 bytes/s (0: unlimited), got {bytes_per_s}")
        if burst_s < 0:
            raise ValueError(f"burst must be >= 0 s, got {burst_s}")
        self.rate = float(bytes_per_s or 0.0)
        self.capacity = self.rate * burst_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = self.capacity
        self._stamp = clock()
        self.waited_s = 0.0  # seconds callers slept for the limit, in total
        self.taken_bytes = 0

    @property
    def limited(self) -> bool:
        return self.rate > 0

    def take(self, nbytes: int) -> float:
        """Account for `nbytes` of I/O, sleeping first as long as the limit asks; returns the seconds slept."""
        if not self.limited or nbytes <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.waited_s += wait
            self.taken_bytes += nbytes
        if wait > 0:
            self._sleep(wait)
        return wait

    def describe(self) -> dict[str, float]:
        """The limit in GB/s (0: none) and the seconds callers waited for it."""
        return {"limit_gbps": self.rate / 1e9, "waited_s": self.waited_s}
