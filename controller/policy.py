"""Write policies: when pages are copied down a tier (GPU -> host, host -> L3)."""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class WritePolicy:
    """When pages are copied down a tier (GPU -> host, host -> L3). These defaults are the server's
    (`cache.write_policy` in the config takes them from here): every page reaches host memory, deferred while
    the GPU pool has room to spare; pages reach the L3 when host memory evicts them."""

    device_to_host: str = "write_through"
    host_to_disk: str = "write_back"
    selective_hits: int = 2  # hits before write_through_selective copies a page down
    # device_to_host write_through only: while more than this share of the GPU pool is free, a new page's host
    # copy waits (it is started when free pages fall to this share, when the page is evicted, or when the engine
    # idles). 1.0: copy every page as soon as it is computed.
    defer_above_free: float = 0.25
    # host_to_disk: write nothing to the L3 (or the shared tier behind it) while the cost model, in mode auto,
    # would load none of it: loading a page from it costs more than recomputing the page. Those writes cost disk
    # bandwidth and engine time and this server never reads them back. False: write anyway (a store kept for
    # servers whose costs differ, or for a restart on faster hardware).
    l3_only_if_loads_pay: bool = True

    def __post_init__(self) -> None:
        for name in ("device_to_host", "host_to_disk"):
            if getattr(self, name) not in WRITE_POLICIES:
                raise ValueError(f"write policy {name}={getattr(self, name)!r}; choices: {list(WRITE_POLICIES)}")
        if not 0.0 <= self.defer_above_free <= 1.0:
            raise ValueError(f"defer_above_free must be in [0, 1], got {self.defer_above_free}")
        if self.selective_hits < 1:
            raise ValueError(f"selective_hits must be >= 1, got {self.selective_hits}")

    @classmethod
    def eager(cls, host_to_disk: str = "write_through") -> WritePolicy:
        """Every page copied down as soon as it is computed: write-through on both tiers, nothing deferred."""
        return cls("write_through", host_to_disk, defer_above_free=1.0)

    @property
    def defers_backups(self) -> bool:
        """Whether GPU -> host write-through copies may wait for memory pressure (see defer_above_free)."""
        return self.device_to_host == "write_through" and self.defer_above_free < 1.0
