"""Write policies: when pages are copied down a tier (GPU -> host, host -> L3)."""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class WritePolicy:
    """When pages are copied down a tier (GPU -> host, host -> L3)."""

    device_to_host: str = "write_through"
    host_to_disk: str = "write_through"
    selective_hits: int = 2

    def __post_init__(self) -> None:
        for name in ("device_to_host", "host_to_disk"):
            if getattr(self, name) not in WRITE_POLICIES:
                raise ValueError(f"write policy {name}={getattr(self, name)!r}; choices: {list(WRITE_POLICIES)}")
        if self.selective_hits < 1:
            raise ValueError(f"selective_hits must be >= 1, got {self.selective_hits}")
