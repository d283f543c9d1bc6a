"""Admission to L3: write a page only once its key has been seen `hits` times (hits=0 admits all)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class AdmitAll:
    """Null admission policy: every key is admitted, nothing is tracked."""

    def note(self, keys: Sequence[bytes]) -> None:
        pass

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        return [True] * len(keys)

    def forget(self, keys: Sequence[bytes]) -> None:
        pass


class HitCountAdmission:
    """Counts sightings per key (note_hit calls and write attempts) in a bounded LRU table.

    A write attempt counts as a sighting, so with hits=2 the second attempt to write a key succeeds.
    Not thread-safe by itself; the store calls it under its lock.
    """

    def __init__(self, hits: int, max_keys: int = 1 << 20) -> None:
        self.hits = hits
        self.max_keys = max_keys
        self.seen: OrderedDict[bytes, int] = OrderedDict()

    def note(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.seen[key] = self.seen.pop(key, 0) + 1
        while len(self.seen) > self.max_keys:
            self.seen.popitem(last=False)

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """Count this attempt for each key, then say which keys have been seen often enough."""
        self.note(keys)
        return [self.seen.get(key, 0) >= self.hits for key in keys]

    def forget(self, keys: Sequence[bytes]) -> None:
        """Drop counts of keys that are now stored."""
        for key in keys:
            self.seen.pop(key, None)


def admission_policy(hits: int) -> AdmitAll | HitCountAdmission:
    """The policy for `admission_hits` (0 or less: admit everything)."""
    return HitCountAdmission(hits) if hits > 0 else AdmitAll()
