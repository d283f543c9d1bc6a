"""The remote tier on a Mooncake Store: the pages of many hicache servers in one Mooncake cluster.

The alternative to Valkey/Redis (tiers/remote/valkey.py) for clusters that already run Mooncake (a `mooncake_master` and
a metadata service). It needs the `mooncake` extra (`pip install 'hicache[mooncake]'`: the
`mooncake-transfer-engine-non-cuda` wheel; Debian needs `libibverbs1 libnl-3-200 libnl-route-3-200` for it to load).

    cache.remote.url: mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata&protocol=tcp

URL parameters: `metadata` (the metadata service: an http URL, or P2PHANDSHAKE), `protocol` (tcp or rdma), `device`
(RDMA devices), `local` (this client's address, default 127.0.0.1), `segment_mib` (memory this client lends the
cluster, default 1024), `buffer_mib` (its transfer buffer, default 64).

Keys and values are those of the Valkey tier: `PREFIX:NAMESPACE:KEY` (hex), a value being the 64-byte header
(`remote.value_header`: format version, key, namespace, checksum over them and the bytes) then the page. Writes go
zero-copy from the host pool (`batch_put_from_multi_buffers`: the header from a small registered buffer per
thread, the page from its host page, registered with the client once). Reads land in a registered staging buffer
per thread and are copied into the host page once verified: a read given up on a timeout may still complete inside
Mooncake, and must not write into a host page that has been given to other bytes since. A value whose header does
not match is a miss, counted (`bad_values`), never served.

Faults: the client's calls block inside Mooncake (a dead master costs ~4 s a call there, and `setup` against a
master that is down does not return), so every call runs on a daemon thread and is given up after `timeout_s`: the
store is then down, answers at once (misses, refused writes) and is set up again after a backoff that doubles from
`retry_min_s` to `retry_max_s`. A cheap `health_check` precedes each batch. One log line when the store goes down,
one when it is back.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import numpy as np

from tiers.l3.format import KEY_BYTES
from tiers.remote.base import (
    HEADER_BYTES,
    RemoteError,
    RemoteStore,
    header_matches,
    host_view,
    parse_server_url,
    value_header,
)

NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND: the key is not (or no longer) in the cluster
RPC_FAILED = -900  # Mooncake's RPC_FAIL: the master cannot be reached


@dataclass(frozen=True)
class MooncakeAddress:
    master: str  # HOST:PORT of mooncake_master
    metadata: str
    protocol: str
    device: str
    local: str
    segment_bytes: int
    buffer_bytes: int

    @classmethod
    def parse(cls, url: str) -> MooncakeAddress:
        """mooncake://HOST:PORT?metadata=...&protocol=tcp&... (see the module doc)."""
        u, port = parse_server_url(url, ("mooncake",), 50051, "master host")
        query = {k: v[-1] for k, v in parse_qs(u.query).items()}
        unknown = set(query) - {"metadata", "protocol", "device", "local", "segment_mib", "buffer_mib"}
        if unknown:
            raise RemoteError(0, f"cache.remote.url {url!r}: unknown parameters {sorted(unknown)}")
        if "metadata" not in query:
            raise RemoteError(0, f"cache.remote.url {url!r}: needs metadata=URL (the metadata service)")
        if query.get("protocol", "tcp") not in ("tcp", "rdma"):
            raise RemoteError(0, f"cache.remote.url {url!r}: protocol must be tcp or rdma")

        def mib(name: str, default: int) -> int:
            value = query.get(name, str(default))
            if not value.isdigit() or int(value) < 1:
                raise RemoteError(0, f"cache.remote.url {url!r}: {name} must be a whole number of MiB >= 1")
            return int(value) << 20

        return cls(f"{u.hostname}:{port}", query["metadata"], query.get("protocol", "tcp"), query.get("device", ""),
                   query.get("local", "127.0.0.1"), mib("segment_mib", 1024), mib("buffer_mib", 64))

    def __str__(self) -> str:
        return f"mooncake://{self.master}"


def _address_of(page: Any) -> int:
    """The address of a page buffer's first byte (a CPU tensor, or anything with the buffer protocol)."""
    if hasattr(page, "data_ptr"):
        return int(page.data_ptr())
    return np.frombuffer(host_view(page), dtype=np.uint8).ctypes.data


class _Client:
    """One set-up Mooncake client, the buffers registered with it and each thread's header buffer."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.registered: set[int] = set()
        self.lock = threading.Lock()
        self.local = threading.local()


class MooncakeStore(RemoteStore):
    """Pages in a Mooncake Store cluster under this cache's namespace; thread-safe. The Valkey store's interface
    and bookkeeping (`tiers.remote.SharedStore`), over Mooncake's client."""

    def __init__(self, url: str, namespace: bytes, page_bytes: int, key_prefix: str = "hicache",
                 timeout_s: float = 2.0, batch_pages: int = 128, admission_hits: int = 0,
                 retry_min_s: float = 0.5, retry_max_s: float = 30.0, client_factory: Callable[[], Any] | None = None,
                 **_redis_only: Any) -> None:
        """client_factory: makes an unset-up client (default: mooncake.store.MooncakeDistributedStore); the
        Valkey tier's credentials and connect timeout (`_redis_only`) do not apply."""
        super().__init__(namespace, page_bytes, batch_pages, admission_hits, retry_min_s, retry_max_s)
        if client_factory is None:
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as e:
                raise RemoteError(0, f"cache.remote.url {url!r}: the Mooncake client is not installed "
                                     f"(pip install 'hicache[mooncake]'): {e}") from e
            client_factory = MooncakeDistributedStore
        self._factory: Callable[[], Any] = client_factory
        self.address: MooncakeAddress = MooncakeAddress.parse(url)
        self.timeout_s = timeout_s
        self._prefix = f"{key_prefix}:{namespace.hex()}:"
        self._client: _Client | None = None
        # (thread, buffer) of calls given up while still running: the buffer lives until the thread ends
        self._abandoned: list[tuple[threading.Thread, Any]] = []
        if self._connect() is None:
            self._report_startup()

    # ---- public API ----

    def key(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def _probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        replies = self._call("probe", lambda c: c.store.batch_is_exist([self.key(k) for k in keys]))
        return None if replies is None else [r == 1 for r in replies]

    def _remove(self, keys: Sequence[bytes]) -> int:
        # leases or not: batch_remove's force flag
        replies = self._call("delete", lambda c: c.store.batch_remove([self.key(k) for k in keys], True))
        return sum(r == 0 for r in replies) if replies else 0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            self._run(client.store.close)

    # ---- internals ----

    def _read_batch(self, keys: Sequence[bytes], out: Sequence[Any], start: int, end: int,
                    results: list[bool]) -> None:
        views = [host_view(out[i]) for i in range(start, end)]
        if any(len(v) != self.page_bytes for v in views):
            raise ValueError(f"page buffers must be {self.page_bytes} bytes")
        client = self._connect()
        if client is None:
            return
        n, value_bytes = end - start, HEADER_BYTES + self.page_bytes
        staging = self._buffer(client, "staging", n * value_bytes)
        ptrs = [staging.ctypes.data + value_bytes * j for j in range(n)]
        names = [self.key(keys[i]) for i in range(start, end)]
        got = self._call("read", lambda c: c.store.batch_get_into(names, ptrs, [value_bytes] * n), client,
                         keep=(client, "staging"))
        if got is None:
            return
        outcomes: Counter[str] = Counter()
        bad: list[bytes] = []
        for j, i in enumerate(range(start, end)):
            size = got[j]
            if size == value_bytes:
                value = staging[value_bytes * j: value_bytes * (j + 1)]
                ok = header_matches(self.namespace, keys[i], value[:HEADER_BYTES], value[HEADER_BYTES:].data,
                                    self.page_bytes)
                if ok:
                    np.frombuffer(views[j], dtype=np.uint8)[:] = value[HEADER_BYTES:]
                outcomes["hit" if ok else "bad"] += 1
                results[i] = ok
                if not ok:
                    bad.append(keys[i])
            elif size == NOT_FOUND:
                outcomes["nil"] += 1
            elif size >= 0:
                outcomes["size"] += 1
                bad.append(keys[i])
            else:
                outcomes["error"] += 1
        self._count_reads(end - start, outcomes, bad)

    def _write_batch(self, keys: Sequence[bytes], pages: Sequence[Any], batch: list[int], results: list[bool],
                     reasons: list[str | None]) -> None:
        if not batch:
            return
        views = []
        for i in batch:
            if len(keys[i]) != KEY_BYTES:
                raise ValueError(f"page key must be {KEY_BYTES} bytes, got {len(keys[i])}")
            view = host_view(pages[i])
            if len(view) != self.page_bytes:
                raise ValueError(f"page must be {self.page_bytes} bytes, got {len(view)}")
            views.append(view)

        client = self._connect()
        replies = None
        if client is not None:
            headers = self._buffer(client, "headers", len(batch) * HEADER_BYTES)
            for j, i in enumerate(batch):
                headers[HEADER_BYTES * j: HEADER_BYTES * (j + 1)] = np.frombuffer(
                    value_header(self.namespace, keys[i], views[j], self.page_bytes), dtype=np.uint8)
            ptrs = [[headers.ctypes.data + HEADER_BYTES * j, self._registered(client, pages[i])]
                    for j, i in enumerate(batch)]
            names = [self.key(keys[i]) for i in batch]
            sizes = [[HEADER_BYTES, self.page_bytes]] * len(batch)
            replies = self._call("write", lambda c: c.store.batch_put_from_multi_buffers(names, ptrs, sizes), client,
                                 keep=(client, "headers"))
        if replies is None:
            for i in batch:
                reasons[i] = "remote_down"
            return
        for i, r in zip(batch, replies):
            if r == 0:
                results[i] = True
            else:
                reasons[i] = "remote_down" if r == RPC_FAILED else "failed"
        self._count_writes(batch, results)

    def _buffer(self, c: _Client, name: str, nbytes: int) -> np.ndarray:
        """The calling thread's registered buffer `name` ("staging" for reads, "headers" for writes), of at least
        `nbytes` (the batch call itself runs on a thread of its own while its caller waits)."""
        buf = getattr(c.local, name, None)
        if buf is None or len(buf) < nbytes:
            size = max(nbytes, self.batch_pages * (HEADER_BYTES + self.page_bytes if name == "staging"
                                                   else HEADER_BYTES))
            buf = np.zeros(size, dtype=np.uint8)
            if c.store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise OSError(f"registering a {buf.nbytes}-byte {name} buffer failed")
            setattr(c.local, name, buf)
        return buf

    def _registered(self, c: _Client, page: Any) -> int:
        """The address of a host page, registered with the client on first use. A page of a tensor registers the
        tensor's whole storage, once: the host pool is one buffer, so one registration covers every page. Other
        buffers register page by page (a bounded set of addresses: pool slots)."""
        ptr = _address_of(page)
        storage = page.untyped_storage() if hasattr(page, "untyped_storage") else None
        base, size = (storage.data_ptr(), storage.nbytes()) if storage is not None else (ptr, self.page_bytes)
        if base not in c.registered:
            with c.lock:
                if base not in c.registered:
                    if c.store.register_buffer(base, size) != 0:
                        raise OSError(f"registering {size} bytes of host memory at {base:#x} failed")
                    c.registered.add(base)
        return ptr

    def _run(self, fn: Callable[[], Any], timeout_s: float | None = None,
             keep: tuple[_Client, str] | None = None) -> tuple[bool, Any]:
        """fn() on a daemon thread, given up after timeout_s: (finished, its result or exception). A call given up
        takes the calling thread's buffer `keep` with it (see `_call`)."""
        with self._lock:
            self._abandoned = [(t, b) for t, b in self._abandoned if t.is_alive()]
        box: list[Any] = []

        def target() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))

        thread = threading.Thread(target=target, name="hicache-mooncake-call", daemon=True)
        thread.start()
        thread.join(self.timeout_s if timeout_s is None else timeout_s)
        if not box:
            if keep is not None:
                client, name = keep
                buf = getattr(client.local, name, None)
                setattr(client.local, name, None)
                with self._lock:
                    self._abandoned.append((thread, buf))
            return False, TimeoutError(f"no answer within {self.timeout_s:.1f} s")
        finished, value = box[0]
        if not finished:
            return False, value
        return True, value

    def _call(self, what: str, fn: Callable[[_Client], Any], client: _Client | None = None,
              keep: tuple[_Client, str] | None = None) -> Any:
        """fn(client) with the store up, or None (the store down, or the call failed and took it down).

        `keep`: the calling thread's buffer the call moves bytes through. A call given up may still write into it
        later, so it leaves this thread (a new one is made for the next call) and stays allocated until the stuck
        call's thread ends. That is why reads land in a staging buffer and are copied into the host page once
        verified: a late write into a host page would corrupt whatever the host tier put there since."""
        client = client or self._connect()
        if client is None:
            return None
        done, value = self._run(lambda: (client.store.health_check(), fn(client)), keep=keep)
        if not done:
            self._down(client, f"{what}: {value}")
            return None
        health, result = value
        if health != 0:
            self._down(client, f"{what}: health check {health} (master unreachable)")
            return None
        if isinstance(result, list) and result and all(r == RPC_FAILED for r in result):
            self._down(client, f"{what}: the master did not answer")
            return None
        return result

    def _connect(self) -> _Client | None:
        """The set-up client; None while the store is down and its retry time has not come."""
        with self._lock:
            if self._client is not None:
                return self._client
            if self._waiting_to_retry():
                return None
        a = self.address

        def setup() -> Any:
            store = self._factory()
            rc = store.setup(a.local, a.metadata, a.segment_bytes, a.buffer_bytes, a.protocol, a.device, a.master)
            if rc != 0:
                raise OSError(f"setup returned {rc}")
            return store

        done, value = self._run(setup)
        if not done:
            self._fail("down", f"setup: {value}")
            return None
        client = _Client(value)
        with self._lock:
            self._mark_up()
            self._client = client
        return client

    def _down(self, client: _Client, why: str) -> None:
        """A call failed: forget the client (a call may still be stuck in it: it is not closed) and back off."""
        with self._lock:
            if self._client is client:
                self._client = None
            self._counters["errors"] += 1
        self._fail("down", why)
