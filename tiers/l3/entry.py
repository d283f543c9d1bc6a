"""An L3Store's in-memory record of one page, and the limits its parts share (tiers/l3/store*.py)."""

from __future__ import annotations

from dataclasses import dataclass

READ_FAILURE_LOG_S = 10.0  # at most one log line of failed reads this often (all are counted in the stats)
TOUCH_FLUSH_ENTRIES = 4096  # flush in-memory access times once this many are pending


@dataclass
class Entry:
    """Where a committed page lives, its key-bound checksum and when it was last used (the LRU order)."""

    slot: int
    checksum: int
    access_ns: int
