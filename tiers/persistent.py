"""The tiers behind the host tier, as the controller's one disk tier: a local L3 store, a shared remote store, or
both.

The tree records a page as "on disk" when it is in either; the controller plans, loads, prefetches and accounts
for disk pages the same way wherever they are. Here the two are combined:

- probes ask the local store first and the remote store for what it lacks;
- reads take each page from the local store when it has it, and from the remote store otherwise (and for a local
  page that fails its checksum);
- writes go to both at once: the local copy is this server's, the remote copy every server's;
- a page evicted from the disk tier leaves the local store only: the shared copy stays for the other servers,
  and the remote server's own LRU evicts it.

The disk tier's capacity is the local store's plus the remote pages this server keeps track of
(`cache.remote.size_*`). The cost model sees one disk bandwidth: calibrated on the local store where there is one
(the remote one otherwise), then measured from the reads serving makes, remote ones included.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiers.l3.store import L3Store
    from tiers.remote.base import RemoteStore


def remote_store_class(url: str) -> type:
    """The remote tier's store for a `cache.remote.url`: Mooncake for mooncake://, Valkey/Redis otherwise."""
    if url.startswith("mooncake://"):
        from tiers.remote.mooncake import MooncakeStore

        return MooncakeStore
    from tiers.remote.valkey import ValkeyStore

    return ValkeyStore


def remote_name(url: str) -> str:
    """A `cache.remote.url` checked and without its credentials (RemoteError where it is malformed)."""
    if url.startswith("mooncake://"):
        from tiers.remote.mooncake import MooncakeAddress

        return str(MooncakeAddress.parse(url))
    from tiers.remote.valkey import ValkeyAddress

    return str(ValkeyAddress.parse(url))


def open_persistent(store_args: dict[str, Any] | None, remote_args: dict[str, Any] | None,
                    remote_pages: int) -> Any:
    """The disk tier's store: an `L3Store`, or a `PersistentTiers` where a remote store is configured."""
    local = None
    if store_args is not None:
        from tiers.l3 import L3Store

        local = L3Store(**store_args)
    if remote_args is None:
        return local
    try:
        remote = remote_store_class(remote_args["url"])(**remote_args)
    except BaseException:
        if local is not None:
            local.close()
        raise
    return PersistentTiers(local, remote, remote_pages)


class PersistentTiers:
    """A local L3 store (or None) and a remote store behind it, with the L3 store's interface."""

    def __init__(self, local: L3Store | None, remote: RemoteStore, remote_pages: int) -> None:
        self.local, self.remote = local, remote
        self.remote_pages = remote_pages
        self.page_bytes = remote.page_bytes
        self.capacity_pages = (local.capacity_pages if local is not None else 0) + remote_pages
        # a write goes to the remote tier on this thread while the local store writes on the caller's
        self._remote_writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-remote-write")

    @property
    def io_backend(self) -> str:
        return self.local.io_backend if self.local is not None else "remote"

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        found = self.local.contains(keys) if self.local is not None else [False] * len(keys)
        rest = [i for i, hit in enumerate(found) if not hit]
        if rest:
            for i, hit in zip(rest, self.remote.contains([keys[i] for i in rest])):
                found[i] = hit
        return found

    def shared_pages(self, keys: Sequence[bytes]) -> int:
        """How many of these disk-tier keys the local store lacks (they are read from the remote tier)."""
        if self.local is None:
            return len(keys)
        return len(keys) - sum(self.local.contains(keys))

    def used_pages(self) -> int:
        local = self.local.used_pages() if self.local is not None else 0
        written: int = self.remote.stats()["writes"]
        return local + min(self.remote_pages, written)

    def note_hit(self, keys: Sequence[bytes]) -> None:
        if self.local is not None:
            self.local.note_hit(keys)
        self.remote.note_hit(keys)

    def write_pages(self, keys: Sequence[bytes], pages: Sequence[Any]) -> list[bool]:
        return self.write_pages_detailed(keys, pages)[0]

    def write_pages_detailed(self, keys: Sequence[bytes],
                             pages: Sequence[Any]) -> tuple[list[bool], list[str | None]]:
        """Write to both; a page is stored if either took it (the reason of a refused page is the local store's
        where there is one)."""
        if self.local is None:
            return self.remote.write_pages_detailed(keys, pages)
        shared = self._remote_writer.submit(self.remote.write_pages_detailed, keys, pages)  # both at once
        try:
            local_ok, local_why = self.local.write_pages_detailed(keys, pages)
        finally:
            remote_ok, _ = shared.result()
        ok = [a or b for a, b in zip(local_ok, remote_ok)]
        return ok, [None if good else why for good, why in zip(ok, local_why)]

    def read_pages(self, keys: Sequence[bytes], out: Sequence[Any]) -> list[bool]:
        results = [False] * len(keys)
        if self.local is not None:
            mine = [i for i, hit in enumerate(self.local.contains(keys)) if hit]
            for i, ok in zip(mine, self.local.read_pages([keys[i] for i in mine], [out[i] for i in mine])):
                results[i] = ok
        rest = [i for i, ok in enumerate(results) if not ok]
        if rest:
            for i, ok in zip(rest, self.remote.read_pages([keys[i] for i in rest], [out[i] for i in rest])):
                results[i] = ok
        return results

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> int:
        """Forget pages here; their shared copies stay for the other servers (the remote server evicts them)."""
        return self.local.delete(keys, wait) if self.local is not None else 0

    def discard(self, keys: Sequence[bytes]) -> int:
        """Delete pages everywhere, the shared copies too: pages written only to be measured."""
        gone = self.local.delete(keys) if self.local is not None else 0
        return gone + self.remote.delete(keys)

    def track_evictions(self) -> None:
        if self.local is not None:
            self.local.track_evictions()

    def take_evicted(self) -> list[bytes]:
        """The local store's evictions: the shared copies stay until the remote server evicts them."""
        return self.local.take_evicted() if self.local is not None else []

    def keys(self) -> list[bytes]:
        return self.local.keys() if self.local is not None else []

    def flush(self) -> None:
        if self.local is not None:
            self.local.flush()

    def check_integrity(self) -> None:
        if self.local is not None:
            self.local.check_integrity()

    def stats(self) -> dict[str, Any]:
        remote = self.remote.stats()
        if self.local is not None:
            return {**self.local.stats(), "remote": remote}
        return {"path": remote["url"], "state": remote["state"], "io_backend": "remote", "pages": 0,
                "capacity_pages": self.capacity_pages, "remote": remote}

    def close(self) -> None:
        self._remote_writer.shutdown(wait=True)
        try:
            if self.local is not None:
                self.local.close()
        finally:
            self.remote.close()

    def __enter__(self) -> PersistentTiers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
