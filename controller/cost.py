"""Load or recompute: how many cached pages of a prefix are worth loading, from calibrated costs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from radix import DEVICE, DISK, HOST


@dataclass(frozen=True)
class CostModel:
    """Seconds to recompute a page versus seconds to load it from host or disk.

    mode "always" loads every cached page, "never" uses only pages already on GPU, "auto" picks
    the prefix length that minimises estimated time (loading page i saves compute_i - load_i).
    Unknown bandwidths or prefill speed (None) count as loading being free.
    """

    page_size: int
    page_bytes: int
    mode: str = "auto"
    prefill_tokens_per_s: float | None = None
    host_to_device_bytes_per_s: float | None = None
    disk_to_device_bytes_per_s: float | None = None
    adaptive: bool = True  # update the disk bandwidth from measured reads (off when it was configured)

    def load_seconds(self, tier: str) -> float:
        if tier == DEVICE:
            return 0.0
        bw = self.host_to_device_bytes_per_s if tier == HOST else self.disk_to_device_bytes_per_s
        return 0.0 if not bw else self.page_bytes / bw

    def compute_seconds(self) -> float:
        if not self.prefill_tokens_per_s:
            return float("inf")
        return self.page_size / self.prefill_tokens_per_s

    def pages_to_load(self, page_tiers: Sequence[tuple[str, int]]) -> int:
        """Number of leading matched pages to use, given (fastest tier, page count) runs in order."""
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
        compute = self.compute_seconds()
        best, best_saving, saving, used = 0, 0.0, 0.0, 0
        for tier, n in page_tiers:
            saving += n * (compute - self.load_seconds(tier))
            used += n
            if saving >= best_saving:  # ties favour loading more (it also warms the GPU tier)
                best, best_saving = used, saving
        return best

    def describe(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "host_to_device_gbps": (self.host_to_device_bytes_per_s or 0) / 1e9,
            "disk_to_device_gbps": (self.disk_to_device_bytes_per_s or 0) / 1e9,
            "load_disk_page": self.load_seconds(DISK) < self.compute_seconds(),
            "adaptive": self.adaptive,
        }
