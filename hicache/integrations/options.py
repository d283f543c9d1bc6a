"""The options an engine's configuration gives hicache's tier: where the store lives, its size, its I/O, its limits
and its remote tier, as a typed record checked with the config's own rules (hicache/config.py), so that a bad key
or value is an error naming it, whichever engine passed it in."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from hicache.config import ConfigError, build_section, check_positive


def machine_threads() -> int:
    """The default thread count of the tier's page I/O and of vLLM's load jobs: half the CPUs this process may run
    on, at least 4 and at most 8. Each thread hands whole chunks to C, and a hand-off costs about as much as copying
    a chunk, so threads beyond the cores only queue: on 2 cores, 8 threads loaded tmpfs slower than 4; on 16 cores,
    4 threads left half the copy rate unused and 8 did best (bench/RESULTS.md, 'Engine tiers against the engines'
    own')."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 8)
    return min(8, max(4, cpus // 2))


@dataclass(frozen=True)
class RemoteOptions:
    """A shared tier behind the local store, on Valkey/Redis (`redis://`) or a Mooncake Store (`mooncake://`):
    the keys of hicache's `cache.remote` (docs/remote-tier.md)."""

    url: str
    size_gib: float = 16.0  # remote chunks this process keeps track of (the remote server evicts on its own)
    username: str | None = None
    password: str | None = None  # also $HICACHE_REMOTE_PASSWORD
    key_prefix: str = "hicache"
    timeout_s: float = 2.0
    admission_hits: int = 0


@dataclass(frozen=True)
class TierOptions:
    """hicache's disk tier as an engine's storage tier. `path` and `size_gib`: the L3 store (a directory holding a
    preallocated slab file and an LMDB index, docs/l3-format.md); `remote`: a shared tier (either or both)."""

    path: str | None = None
    size_gib: float | None = None
    io_backend: Literal["auto", "kvikio", "posix", "buffered"] = "auto"
    io_threads: int = field(default_factory=machine_threads)  # threads of the store's page I/O
    # vLLM load jobs run at once, each spreading its chunks over the I/O threads (SGLang reads on its own threads)
    jobs_threads: int = field(default_factory=machine_threads)
    read_batch_mib: int = 16  # vLLM load jobs waiting together are read by one store call of up to this (0: one each)
    queue_chunks: int = 4096  # chunks waiting to be written, at most; beyond it a store job fails at once
    sync_batch_mib: int = 256  # bytes per fdatasync and index commit (a group is one hand-off to the I/O threads)
    admission_hits: int = 0  # store a chunk only once it was offered this many times (0: always)
    read_limit_gbps: float = 0.0  # the store's bandwidth caps (0: none)
    write_limit_gbps: float = 0.0
    namespace: str = ""  # a name that keeps this deployment's chunks apart from others' in one remote tier
    remote: RemoteOptions | None = None

    @classmethod
    def parse(cls, data: dict[str, Any], source: str) -> TierOptions:
        """Options from an engine's configuration (ConfigError naming the bad key and `source` otherwise)."""
        options: TierOptions = build_section(cls, dict(data), "", source)
        options.check(source)
        return options

    def check(self, source: str) -> None:
        if self.path is None and self.remote is None:
            raise ConfigError(f"{source}: give `path` (a local store), `remote` (a shared one), or both")
        if self.path is not None:
            if not self.path.strip():
                raise ConfigError(f"{source}: path: must not be empty")
            if self.size_gib is None:
                raise ConfigError(f"{source}: size_gib: required with `path` (the local store's capacity)")
            check_positive(self.size_gib, "size_gib", source)
        for name in ("io_threads", "jobs_threads", "queue_chunks", "sync_batch_mib"):
            check_positive(getattr(self, name), name, source)
        for name in ("admission_hits", "read_batch_mib", "read_limit_gbps", "write_limit_gbps"):
            check_positive(getattr(self, name), name, source, allow_zero=True)
        if self.remote is not None:
            from tiers.persistent import remote_name
            from tiers.remote import RemoteError

            try:
                remote_name(self.remote.url)
            except RemoteError as e:
                raise ConfigError(f"{source}: remote.url: {e.strerror or e}") from None
            check_positive(self.remote.size_gib, "remote.size_gib", source)
            check_positive(self.remote.timeout_s, "remote.timeout_s", source)
            check_positive(self.remote.admission_hits, "remote.admission_hits", source, allow_zero=True)

    def describe(self) -> dict[str, str | float]:
        """The options worth a label or a log line, the remote tier's credentials left out."""
        out: dict[str, str | float] = {"path": self.path or "", "size_gib": self.size_gib or 0.0,
                                       "io_backend": self.io_backend}
        if self.remote is not None:
            from tiers.persistent import remote_name

            out["remote"] = remote_name(self.remote.url)
        return out
