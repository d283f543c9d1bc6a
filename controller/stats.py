"""Counters of the tier controller: hits, page movement, evictions and drops, per tier."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from radix import TIERS

# Hits are counted per tier a page was served from: the tree's tiers, and the remote tier, whose pages the tree
# records as disk pages (tiers/persistent.py) but which this server's local store does not hold.
REMOTE = "remote"
HIT_TIERS = (*TIERS, REMOTE)


@dataclass
class CacheStats:
    """Monotonic counters; `snapshot()` gives a plain dict for metrics and tests."""

    prompt_tokens: int = 0
    hit_tokens: Counter[str] = field(default_factory=Counter)  # tier -> prompt tokens served from it
    # tier -> cached tokens recomputed there because loading them was dearer (or their reads were given up)
    recomputed: Counter[str] = field(default_factory=Counter)
    pages_promoted: Counter[tuple[str, str]] = field(default_factory=Counter)  # (src, dst) -> pages
    pages_demoted: Counter[tuple[str, str]] = field(default_factory=Counter)  # (src, dst) -> pages
    bytes_moved: Counter[tuple[str, str]] = field(default_factory=Counter)  # (src, dst) -> bytes
    evictions: Counter[str] = field(default_factory=Counter)  # tier -> pages dropped from that tier
    drops: Counter[str] = field(default_factory=Counter)  # reason -> pages not backed up / not loaded
    load_failures: int = 0  # L3 reads that missed or failed verification
    prefetched_pages: int = 0  # L3 -> host reads started for queued requests
    staged_pages: int = 0  # host -> GPU copies started for queued requests (controller/staging.py)
    gave_up_reads: int = 0  # requests that stopped waiting for disk reads at their deadline and computed instead
    deferred_pages: int = 0  # new GPU pages whose write-through copy to host waited for memory pressure or idle
    eviction_backups: int = 0  # GPU pages copied to host as they were evicted (compute waits for those copies)
    backup_waits: int = 0  # GPU pages freed while their copy to host was in flight: the compute stream waited for it
    host_free_wait_s: float = 0.0  # seconds the caller waited for copies landing in freed host pages (no other room)

    def moved(self, src: str, dst: str, pages: int, page_bytes: int) -> None:
        promote = TIERS.index(dst) < TIERS.index(src)
        (self.pages_promoted if promote else self.pages_demoted)[(src, dst)] += pages
        self.bytes_moved[(src, dst)] += pages * page_bytes

    @property
    def recomputed_tokens(self) -> int:
        """Cached tokens recomputed, all tiers."""
        return sum(self.recomputed.values())

    def snapshot(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": {t: self.hit_tokens[t] for t in HIT_TIERS},
            "recomputed_tokens": self.recomputed_tokens,
            "recomputed_by_tier": {t: self.recomputed[t] for t in HIT_TIERS},
            "pages_promoted": {f"{s}->{d}": n for (s, d), n in self.pages_promoted.items()},
            "pages_demoted": {f"{s}->{d}": n for (s, d), n in self.pages_demoted.items()},
            "bytes_moved": {f"{s}->{d}": n for (s, d), n in self.bytes_moved.items()},
            "evictions": {t: self.evictions[t] for t in TIERS},
            "drops": dict(self.drops),
            "load_failures": self.load_failures,
            "prefetched_pages": self.prefetched_pages,
            "staged_pages": self.staged_pages,
            "gave_up_reads": self.gave_up_reads,
            "deferred_pages": self.deferred_pages,
            "eviction_backups": self.eviction_backups,
            "backup_waits": self.backup_waits,
            "host_free_wait_s": self.host_free_wait_s,
        }
