"""LRU stack depth of every block access in a trace (Mattson): reuse distances and capacity curves.

A request touches its blocks last to first, so its first block ends most recent (the replay's
recency rule). The depth of an access is 1 + the number of distinct blocks touched since the
block's previous touch, measured before the request touches anything; 0 means first access.
Under write_through + LRU every tier holds its most recent blocks, so a block of depth d is
served by the fastest tier holding at least d blocks: one pass gives hit rates for any sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hicache.replay.trace import TraceRecord


@dataclass
class ReuseProfile:
    """Per request: the stack depth (0 = cold) and age in ms (-1 = cold) of each block access."""

    depths: list[list[int]]
    ages_ms: list[list[float]]
    histogram: dict[int, int]  # depth -> accesses (depth 0: cold)

    def hits_within(self, capacity: int) -> int:
        """Block accesses an LRU cache of `capacity` blocks would hit (prefix rule included)."""
        return sum(n for d, n in self.histogram.items() if 0 < d <= capacity)

    def capacity_for(self, hits: int) -> int:
        """The smallest capacity (blocks) whose LRU cache hits at least `hits` accesses (0 if hits <= 0)."""
        if hits <= 0:
            return 0
        total = 0
        for d in sorted(k for k in self.histogram if k > 0):
            total += self.histogram[d]
            if total >= hits:
                return d
        return max(self.histogram, default=0)


def stack_depths(records: Sequence[TraceRecord]) -> ReuseProfile:
    """Stack depth of every block access (Fenwick tree over touch positions, O(log n) per access)."""
    size = sum(len(r.hash_ids) for r in records) + 1
    fenwick = [0] * (size + 1)  # one mark per distinct block, at the position of its last touch
    last_pos: dict = {}
    last_ts: dict = {}
    live = 0
    pos = 0
    all_depths: list[list[int]] = []
    all_ages: list[list[float]] = []
    histogram: dict[int, int] = {}
    for rec in records:
        ids = rec.hash_ids
        ts = rec.timestamp_ms
        depths = []
        ages = []
        for x in ids:
            p = last_pos.get(x)
            if p is None:
                depths.append(0)
                ages.append(-1.0)
                continue
            before = 0  # marks at positions [1, p]
            i = p
            while i:
                before += fenwick[i]
                i &= i - 1
            depths.append(live - before + 1)
            ages.append(ts - last_ts[x])
        for d in depths:
            histogram[d] = histogram.get(d, 0) + 1
        for x in reversed(ids):
            p = last_pos.get(x)
            if p is None:
                live += 1
            else:
                i = p
                while i <= size:
                    fenwick[i] -= 1
                    i += i & -i
            pos += 1
            i = pos
            while i <= size:
                fenwick[i] += 1
                i += i & -i
            last_pos[x] = pos
            last_ts[x] = ts
        all_depths.append(depths)
        all_ages.append(ages)
    return ReuseProfile(all_depths, all_ages, histogram)
