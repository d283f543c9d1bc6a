"""Load or recompute: how many cached pages of a prefix are worth loading, from calibrated costs."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from radix import DEVICE, DISK, HOST


def clip_runs(runs: list[tuple[str, int]], pages: int) -> list[tuple[str, int]]:
    """The (tier, pages) runs of a matched prefix cut down to their first `pages` pages."""
    out = []
    for tier, n in runs:
        if pages <= 0:
            break
        out.append((tier, min(n, pages)))
        pages -= n
    return out


class LoadPlan(NamedTuple):
    """How to use a matched prefix of pages: load [0, k), compute [k, s) while [s, n) loads, then go on
    from page n. Without a gap (k == s) it is the one-cut plan: k == s == n."""

    k: int
    s: int
    n: int


@dataclass(frozen=True)
class CostModel:
    """Seconds to recompute a page versus seconds to load it from host or disk.

    mode "always" loads every cached page (and its request waits for the reads however long they take), "never"
    uses only pages already on GPU, "auto" picks the prefix length that minimises estimated time (loading page i
    saves compute_i - load_i; a request waits for disk reads only until a deadline, hicache/engine/scheduler.py).
    Unknown bandwidths or prefill speed (None) count as loading being free.

    Recomputing a page costs more the deeper it sits in the prompt: each of its tokens attends to every
    token before it. A token at position t costs 1 / prefill_tokens_per_s + t * attention_seconds_per_pair
    (0: every position alike). With an 8B model on an H200 that doubles a token's cost by ~30k tokens of
    context, so a store too slow to pay at the start of a prompt can pay deep in it.

    With `overlap` (mode "auto", costs known) `plan` may also split the prefix three ways: compute
    some pages on the GPU while later ones load, so that both finish together (see `plan`).

    Host pages are priced apart from the disk's in two cases (`plan`'s and `pages_to_load`'s `busy`, and
    `host_streams`). While the GPU has other requests' work queued (`busy`), recomputing a host page spends
    GPU time they wait for, and loading it spends copy-engine time nobody else needs: every host page loads,
    and none is computed in a gap. Where host loads stream in under the forward layer by layer
    (`host_streams`, tiers/layered_copy.py), a gap over host pages computes what would have arrived while the
    GPU worked anyway: no gap covers host pages then either.
    """

    page_size: int
    page_bytes: int
    mode: str = "auto"
    prefill_tokens_per_s: float | None = None
    host_to_device_bytes_per_s: float | None = None
    disk_to_device_bytes_per_s: float | None = None
    attention_seconds_per_pair: float = 0.0  # prefill seconds per (token, earlier token) pair: see above
    adaptive: bool = True  # update the disk bandwidth from measured reads (off when it was configured)
    overlap: bool = False  # allow plans that compute a gap while the pages after it load
    host_streams: bool = False  # host -> GPU loads run layer by layer under the forward (see above)

    def load_seconds(self, tier: str, busy: bool = False) -> float:
        """Seconds to load a page from `tier`; `busy`: the GPU has other work queued, and a host page's load takes
        only copy-engine time nobody else needs (see the class doc): nothing."""
        if tier == DEVICE or busy and tier == HOST:
            return 0.0
        bw = self.host_to_device_bytes_per_s if tier == HOST else self.disk_to_device_bytes_per_s
        return 0.0 if not bw else self.page_bytes / bw

    def compute_seconds(self, start: int = 0, end: int | None = None) -> float:
        """Seconds to recompute pages [start, end) of a prompt (end: start + 1), their attention to earlier tokens
        included."""
        if not self.prefill_tokens_per_s:
            return float("inf")
        end = start + 1 if end is None else end
        return self._computed_by(end) - self._computed_by(start)

    def _computed_by(self, page: int) -> float:
        """Seconds to compute pages [0, page) of a prompt."""
        return self.prefix_compute_seconds(page * self.page_size)

    def prefix_compute_seconds(self, tokens: int) -> float:
        """Seconds to compute a prompt's first `tokens` tokens: tokens / speed + their (token, earlier token) pairs
        x the attention price. Needs a known prefill speed."""
        assert self.prefill_tokens_per_s, "compute seconds need a known prefill speed"
        return tokens / self.prefill_tokens_per_s + self.attention_seconds_per_pair * tokens * (tokens - 1) / 2

    def prefill_seconds(self, start: int, end: int) -> float:
        """Seconds to prefill tokens [start, end) of a prompt (0 where the prefill speed is unknown or the range is
        empty): the queue of prefill ahead of a request, as the scheduler's deadlines count it."""
        if not self.prefill_tokens_per_s or end <= start:
            return 0.0
        return self.prefix_compute_seconds(end) - self.prefix_compute_seconds(start)

    def pages_to_load(self, page_tiers: Sequence[tuple[str, int]], busy: bool = False) -> int:
        """Number of leading matched pages to use, given (fastest tier, page count) runs in order; `busy`: the GPU
        has other work queued (host pages then load whatever they cost: see the class doc)."""
        total = sum(n for _, n in page_tiers)
        if self.mode == "always":
            return total
        if self.mode == "never":
            used = 0
            for tier, n in page_tiers:
                if tier != DEVICE:
                    break
                used += n
            return used
        best, best_saving, saving, used = 0, 0.0, 0.0, 0
        for tier, n in page_tiers:
            saving += self.compute_seconds(used, used + n) - n * self.load_seconds(tier, busy)
            used += n
            if saving >= best_saving:  # ties favour loading more (it also warms the GPU tier)
                best, best_saving = used, saving
        return best

    def plan(self, page_tiers: Sequence[tuple[str, int]], busy: bool = False) -> LoadPlan:
        """The plan for a matched prefix, given (fastest tier, page count) runs in order; `busy`: the GPU has other
        work queued (see the class doc: host pages then always load).

        Without overlap (or unknown costs, or mode other than "auto") it is the one-cut plan of
        `pages_to_load`. With overlap the plan of least `finish_seconds` among: [0, k) loaded with k at
        a run boundary, [k, s) computed while [s, n) loads, n at a run boundary, s balancing the two.
        Pure load (s == k) comes back as (n, n, n), pure compute (s == n) as (k, k, k).
        """
        if not self._can_overlap(page_tiers):
            k = self.pages_to_load(page_tiers, busy)
            return LoadPlan(k, k, k)
        host, disk = self._load_prefix_sums(page_tiers, busy)
        # where a gap must not cover host pages: the first host page at or after each page (len: none)
        host_gap_end = self._next_host_pages(page_tiers) if busy or self.host_streams else None
        # cut where the tier changes: a prefix of many nodes in one tier is one run, so the plan does not depend on
        # how the tree split it, and the search below (quadratic in the runs) stays small as sessions grow
        bounds = [0]
        last = None
        for tier, n in page_tiers:
            if tier == last and len(bounds) > 1:
                bounds[-1] += n
            else:
                bounds.append(bounds[-1] + n)
            last = tier
        best: tuple[float, int, LoadPlan] | None = None
        for k in bounds:
            for n in bounds:
                if n < k:
                    continue
                s = self._balance(host, disk, k, n)
                if host_gap_end is not None:
                    s = min(s, max(k, host_gap_end[k]))  # the gap stops at the first host page
                for cand in {s, max(k, s - 1)}:
                    t = self._finish(host, disk, bounds[-1], k, cand, n)
                    key = (t, (cand - k) + (bounds[-1] - n), LoadPlan(k, cand, n))  # ties: compute less
                    if best is None or key[:2] < best[:2]:
                        best = key
        assert best is not None
        k, s, n = best[2]
        if s == k:
            return LoadPlan(n, n, n)
        if s == n:
            return LoadPlan(k, k, k)
        return LoadPlan(k, s, n)

    def finish_seconds(self, page_tiers: Sequence[tuple[str, int]], plan: LoadPlan) -> float:
        """Estimated seconds until every matched page's KV is on the GPU under `plan` (pages past n
        recomputed after it). Host and disk loads run on separate links, in parallel with compute;
        the gap's compute starts once [0, k) is loaded (it attends to those pages)."""
        host, disk = self._load_prefix_sums(page_tiers)
        return self._finish(host, disk, len(host) - 1, *plan)

    @staticmethod
    def _next_host_pages(page_tiers: Sequence[tuple[str, int]]) -> list[int]:
        """For every page position i (and the end), the first host page at or after i (the end where none is)."""
        tiers = [tier for tier, n in page_tiers for _ in range(n)]
        out = [len(tiers)] * (len(tiers) + 1)
        for i in range(len(tiers) - 1, -1, -1):
            out[i] = i if tiers[i] == HOST else out[i + 1]
        return out

    def _can_overlap(self, page_tiers: Sequence[tuple[str, int]]) -> bool:
        if not self.overlap or self.mode != "auto" or not self.prefill_tokens_per_s:
            return False
        tiers = {tier for tier, n in page_tiers if n}
        return (HOST not in tiers or bool(self.host_to_device_bytes_per_s)) and (
            DISK not in tiers or bool(self.disk_to_device_bytes_per_s)
        )

    def _load_prefix_sums(self, page_tiers: Sequence[tuple[str, int]],
                          busy: bool = False) -> tuple[list[float], list[float]]:
        """Seconds to load pages [0, i) over the host link and over the disk link, for every i (`busy`: as
        `load_seconds` prices them then)."""
        host, disk = [0.0], [0.0]
        for tier, n in page_tiers:
            cost = self.load_seconds(tier, busy)
            for _ in range(n):
                host.append(host[-1] + (cost if tier == HOST else 0.0))
                disk.append(disk[-1] + (cost if tier == DISK else 0.0))
        return host, disk

    def _finish(self, host: list[float], disk: list[float], total: int, k: int, s: int, n: int) -> float:
        prefix = max(host[k], disk[k])  # [0, k) loaded
        gap = prefix + self.compute_seconds(k, s)  # [k, s) computed after it
        tail = max(host[k] + host[n] - host[s], disk[k] + disk[n] - disk[s])  # [s, n) loads queue behind [0, k)
        return max(gap, tail) + self.compute_seconds(n, total)

    def _balance(self, host: list[float], disk: list[float], k: int, n: int) -> int:
        """The least s in [k, n] where computing [k, s) takes at least as long as loading [s, n)."""
        prefix = max(host[k], disk[k])

        def gap_done_first(s: int) -> bool:  # False for small s, True from the balance point on
            tail = max(host[k] + host[n] - host[s], disk[k] + disk[n] - disk[s])
            return prefix + self.compute_seconds(k, s) >= tail

        return bisect.bisect_left(range(k, n + 1), True, key=gap_done_first) + k

    def pays_from_token(self, tier: str) -> int | None:
        """The first prompt position (a page boundary) from which loading a page of `tier` costs less than
        recomputing it; None if no position does. 0 where costs are unknown."""
        load = self.load_seconds(tier)
        if not load or not self.prefill_tokens_per_s:
            return 0
        if load < self.compute_seconds():
            return 0
        per_page = self.compute_seconds(1) - self.compute_seconds(0)  # what each page deeper adds
        if per_page <= 0:
            return None
        page = math.ceil((load - self.compute_seconds()) / per_page)
        while page > 0 and load < self.compute_seconds(page - 1):  # float rounding: the least such page
            page -= 1
        while not load < self.compute_seconds(page):
            page += 1
        return page * self.page_size

    def describe(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "attention_ns_per_pair": self.attention_seconds_per_pair * 1e9,
            "host_to_device_gbps": (self.host_to_device_bytes_per_s or 0) / 1e9,
            "disk_to_device_gbps": (self.disk_to_device_bytes_per_s or 0) / 1e9,
            "load_disk_page": self.load_seconds(DISK) < self.compute_seconds(),
            "disk_pays_from_token": self.pays_from_token(DISK),
            "adaptive": self.adaptive,
            "overlap": self.overlap,
        }
