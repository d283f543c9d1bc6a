"""LRU stack depth of every block access in a trace (Mattson): reuse distances and capacity curves.

A request touches its blocks last to first, so its first block ends most recent (the replay's
recency rule). The depth of an access is 1 + the number of distinct blocks touched since the
block's previous touch, measured before the request touches anything; 0 means first access.
Under write_through + LRU every tier holds its most recent blocks, so a block of depth d is
served by the fastest tier holding at least d blocks: one pass gives hit rates for any sizes.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hicache.replay.trace import TraceRecord
from tiers import native


# The same pass in C (reuse_stack.c, built at install): a pure-Python Fenwick tree took 10 s of a 14 s replay of
# 2.9M agent-session blocks. Same results; the Python loop below runs where the library is not built.
@functools.cache
def _native_lib():
    """The compiled pass, once per process; None where it cannot be had."""
    lib = native.load(Path(__file__).parent, "_reuse_stack", "replay stack-depth pass")
    if lib is not None:
        p = ctypes.c_void_p
        lib.hicache_stack_depths.argtypes = (p, ctypes.c_int64, p, ctypes.c_int64, p, ctypes.c_int64, p, p)
        lib.hicache_stack_depths.restype = ctypes.c_int
    return lib


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


def stack_depths(records: Sequence[TraceRecord], native: bool = True) -> ReuseProfile:
    """Stack depth of every block access (Fenwick tree over touch positions, O(log n) per access); in C where it
    can be compiled (`native`), else in Python."""
    lib = _native_lib() if native else None
    if lib is not None:
        return _stack_depths_native(lib, records)
    return _stack_depths_python(records)


def _stack_depths_native(lib, records: Sequence[TraceRecord]) -> ReuseProfile:
    import numpy as np

    index: dict = {}
    dense = [index.setdefault(x, len(index)) for r in records for x in r.hash_ids]
    n = len(dense)
    ids = np.asarray(dense, dtype=np.int64)
    starts = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum([len(r.hash_ids) for r in records], out=starts[1:])
    ts = np.asarray([r.timestamp_ms for r in records], dtype=np.float64)
    depths = np.empty(n, dtype=np.int64)
    ages = np.empty(n, dtype=np.float64)
    ptr = lambda a: a.ctypes.data  # noqa: E731
    if lib.hicache_stack_depths(ptr(ids), n, ptr(starts), len(records), ptr(ts), len(index), ptr(depths),
                                ptr(ages)):
        raise MemoryError(f"the stack-depth pass could not allocate its tables for {n:,} accesses")
    values, counts = np.unique(depths, return_counts=True)
    flat_depths, flat_ages, bounds = depths.tolist(), ages.tolist(), starts.tolist()
    return ReuseProfile([flat_depths[a:b] for a, b in zip(bounds, bounds[1:])],
                        [flat_ages[a:b] for a, b in zip(bounds, bounds[1:])],
                        dict(zip(values.tolist(), counts.tolist())))


def _stack_depths_python(records: Sequence[TraceRecord]) -> ReuseProfile:
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
