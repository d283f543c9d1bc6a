"""Write policies: when pages are copied down a tier (GPU -> host, host -> L3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from controller.reuse import ADMIT_MODES

WritePolicyName = Literal["write_through", "write_through_selective", "write_back"]
WRITE_POLICIES = get_args(WritePolicyName)


@dataclass(frozen=True)
class WritePolicy:
    """When pages are copied down a tier (GPU -> host, host -> L3). It is also the config's
    `cache.write_policy` (hicache/config.py), so these defaults are the server's (and configs/default.yaml's):
    every page reaches host memory, deferred while the GPU pool has room to spare; pages likely to be read again
    reach the L3 as soon as they are in host memory, so host eviction drops copies the L3 already holds instead of
    waiting for the disk (controller/reuse.py says which pages, controller/writes.py how fast)."""

    device_to_host: WritePolicyName = "write_through"
    host_to_disk: WritePolicyName = "write_through"
    selective_hits: int = 2  # hits before write_through_selective copies a page down
    # device_to_host write_through only: while more than this share of the GPU pool is free, a new page's host
    # copy waits (it is started when free pages fall to this share, when the page is evicted, or when the engine
    # idles). 1.0: copy every page as soon as it is computed.
    defer_above_free: float = 0.25
    # host_to_disk: which pages the L3 (and the remote tier behind it) takes. "reuse": pages likely to be read
    # again (hit, continuing a hit, or computed twice: controller/reuse.py), so a workload without reuse costs the
    # disk nothing; "all": every page the write policy sends
    l3_admit: Literal["reuse", "all"] = "reuse"
    # host_to_disk: queued L3 writes pin at most this share of the host pool; further writes wait, unpinned, for
    # their turn, so a disk slower than the stream of new pages never leaves GPU -> host copies without room.
    # With prefetch's share (load_policy.prefetch_host_share, 0.5) a quarter of the pool stays for those copies.
    # An eighth left too little on a disk slower than the GPU computes new pages: writes were dropped as
    # `l3_backlog` and their pages recomputed at the next turn (bench/RESULTS.md, 'The disk adds its bandwidth')
    l3_host_share: float = 0.25

    def __post_init__(self) -> None:
        for name in ("device_to_host", "host_to_disk"):
            if getattr(self, name) not in WRITE_POLICIES:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {list(WRITE_POLICIES)}")
        if not 0.0 <= self.defer_above_free <= 1.0:
            raise ValueError(f"defer_above_free: must be in [0, 1], got {self.defer_above_free}")
        if self.l3_admit not in ADMIT_MODES:
            raise ValueError(f"l3_admit: {self.l3_admit!r} is not one of {list(ADMIT_MODES)}")
        if not 0.0 < self.l3_host_share <= 1.0:
            raise ValueError(f"l3_host_share: must be in (0, 1], got {self.l3_host_share}")
        if self.selective_hits < 1:
            raise ValueError(f"selective_hits: must be >= 1, got {self.selective_hits}")

    @classmethod
    def eager(cls, host_to_disk: WritePolicyName = "write_through") -> WritePolicy:
        """Every page copied down as soon as it is computed: write-through on both tiers, nothing deferred, every
        page admitted to the L3, and no cap on the host pages queued writes pin."""
        return cls("write_through", host_to_disk, defer_above_free=1.0, l3_admit="all", l3_host_share=1.0)

    @property
    def defers_backups(self) -> bool:
        """Whether GPU -> host write-through copies may wait for memory pressure (see defer_above_free)."""
        return self.device_to_host == "write_through" and self.defer_above_free < 1.0
