"""Tier capacities in pages: the config's sizes (GiB or tokens) once the model's KV bytes per token is known."""

from __future__ import annotations

from dataclasses import dataclass

from hicache.config import DEFAULT_L3_GIB, DEFAULT_REMOTE_GIB, Config, ConfigError


@dataclass(frozen=True)
class ResolvedSizes:
    """Tier capacities in pages (0 = tier disabled) for a model's KV bytes per page."""

    page_size: int
    page_bytes: int
    device_pages: int
    host_pages: int
    disk_pages: int
    remote_pages: int = 0  # the remote tier's pages this server tracks (they share the disk tier's place)

    def bytes(self, tier: str) -> int:
        return getattr(self, f"{tier}_pages") * self.page_bytes

    def tokens(self, tier: str) -> int:
        return getattr(self, f"{tier}_pages") * self.page_size


def _pages(size_gib: float | None, size_tokens: int | None, page_size: int, page_bytes: int) -> int:
    if size_tokens is not None:
        return size_tokens // page_size
    if size_gib is None:
        return 0
    return int(size_gib * (1 << 30)) // page_bytes


def resolve_sizes(cfg: Config, kv_bytes_per_token: int) -> ResolvedSizes:
    """Tier sizes in pages for a model whose KV takes kv_bytes_per_token bytes per token."""
    c = cfg.cache
    page_bytes = kv_bytes_per_token * c.page_size
    device = _pages(c.device.size_gib, c.device.size_tokens, c.page_size, page_bytes)
    if device < 1:
        raise ConfigError(f"cache.device: {device} pages is too small; the GPU tier needs at least one page")
    host = _pages(c.host.size_gib, c.host.size_tokens, c.page_size, page_bytes)
    disk = remote = 0
    if c.l3.path is not None:
        gib = c.l3.size_gib if c.l3.size_gib is not None or c.l3.size_tokens is not None else DEFAULT_L3_GIB
        disk = _pages(gib, c.l3.size_tokens, c.page_size, page_bytes)
    if c.remote.url is not None:
        r = c.remote
        gib = r.size_gib if r.size_gib is not None or r.size_tokens is not None else DEFAULT_REMOTE_GIB
        remote = _pages(gib, r.size_tokens, c.page_size, page_bytes)
    return ResolvedSizes(c.page_size, page_bytes, device, host, disk, remote)
