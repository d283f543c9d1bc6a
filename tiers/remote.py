"""The shared tier: pages in a Valkey or Redis server that many hicache servers use as one pool of prefixes.

The store speaks the Redis protocol (RESP2) itself, over plain sockets, for three reasons: page bytes go from the
host pool into the socket and back with no copy in Python (`sendmsg` of the page's memory; `recv_into` the page),
every call has a timeout, and nothing is needed but the server binary. Batches of pages are pipelined: one write
of all the commands, then the replies in order.

Keys: `PREFIX:NAMESPACE:KEY` (hex), the namespace being the cache's (model, revision, dtype, KV layout, page size,
TP rank): servers of other models never see each other's pages. A value is a 64-byte header then the page's bytes:

    magic "HCRP", format version (u16), flags (u16), page length (u64), checksum (u64), key (16 B), namespace (16 B)

the checksum being xxh3(namespace + key + xxh3(bytes)) as in the L3 (tiers/l3/format.py `bound_checksum`). A value
whose header or checksum does not match is a miss, counted (`bad_values`), never served.

The server evicts on its own (`maxmemory` with `allkeys-lru`): a key seen by `contains` may be gone by the time it is
read. That read is a miss, and the request recomputes the page.

Faults: a call that fails to connect, times out or loses its connection marks the store down; while down every call
answers at once (misses, refused writes) and the next connection is tried after a backoff that doubles from
`retry_min_s` to `retry_max_s`. One log line when the store goes down, one when it is back. A wrong password is
state `auth_failed`; a full server (`OOM` replies under `noeviction`) refuses writes as `remote_full`.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from tiers.l3.admission import admission_policy
from tiers.l3.format import KEY_BYTES, NAMESPACE_BYTES, bound_checksum, checksum

logger = logging.getLogger(__name__)

MAGIC = b"HCRP"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQQ16s16s")
HEADER_BYTES = 64  # HEADER (56 bytes), zero-padded
BATCH_BYTES = 64 << 20  # pages per pipelined batch: at most `batch_pages`, and about this many bytes
COUNTERS = ("reads", "read_bytes", "hits", "misses", "vanished", "bad_values", "writes", "write_bytes",
            "write_refused", "not_admitted", "full", "probes", "probe_hits", "errors", "reconnects", "deletes")


class RemoteError(OSError):
    """The remote store cannot be used as configured; the message names the server and the reason."""


def parse_server_url(url: str, schemes: Sequence[str], default_port: int, host_word: str) -> tuple[Any, int]:
    """`url` split (urlparse) with its port (default_port if none); RemoteError naming what is wrong for a scheme
    not in `schemes`, no host (`host_word`: what the host is called in the message), or a bad port."""
    u = urlparse(url)
    if u.scheme not in schemes:
        raise RemoteError(0, f"cache.remote.url {url!r}: the scheme must be "
                             + " or ".join(f"{scheme}://" for scheme in schemes))
    if not u.hostname:
        raise RemoteError(0, f"cache.remote.url {url!r}: no {host_word}")
    try:
        return u, u.port or default_port
    except ValueError as e:
        raise RemoteError(0, f"cache.remote.url {url!r}: {e}") from e


@dataclass(frozen=True)
class RemoteAddress:
    host: str
    port: int
    db: int
    username: str | None
    password: str | None

    @classmethod
    def parse(cls, url: str, username: str | None = None, password: str | None = None) -> RemoteAddress:
        """redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] (valkey:// too); explicit credentials win over the URL's."""
        u, port = parse_server_url(url, ("redis", "valkey"), 6379, "host")
        path = u.path.strip("/")
        if path and not path.isdigit():
            raise RemoteError(0, f"cache.remote.url {url!r}: the path must be a database number, got {path!r}")
        return cls(u.hostname, port, int(path or 0), username or (unquote(u.username) if u.username else None),
                   password or (unquote(u.password) if u.password else None))

    def __str__(self) -> str:  # never the password
        return f"redis://{self.host}:{self.port}/{self.db}"


class ReplyError(Exception):
    """An error reply (`-ERR ...`) from the server."""


class _Connection:
    """One socket to the server, with a read buffer; RESP2 requests and replies."""

    def __init__(self, address: RemoteAddress, connect_timeout_s: float, timeout_s: float) -> None:
        self.sock = socket.create_connection((address.host, address.port), timeout=connect_timeout_s)
        self.sock.settimeout(timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.pos = 0

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    @staticmethod
    def command(*args: bytes | memoryview) -> list[bytes | memoryview]:
        """The RESP encoding of one command, as buffers to send (big arguments are not copied)."""
        out: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
        for a in args:
            out.append(b"$%d\r\n" % len(a))
            out.append(a)
            out.append(b"\r\n")
        return out

    def send(self, buffers: list[bytes | memoryview]) -> None:
        """Send every buffer (sendmsg: the kernel gathers them, nothing is joined here)."""
        views = [memoryview(b).cast("B") for b in buffers]
        first = 0
        while first < len(views):
            sent = self.sock.sendmsg(views[first:first + 512])
            while sent:
                if sent >= len(views[first]):
                    sent -= len(views[first])
                    first += 1
                else:
                    views[first] = views[first][sent:]
                    sent = 0

    def _fill(self) -> None:
        if self.pos > 1 << 16 and self.pos == len(self.buf):
            self.buf.clear()
            self.pos = 0
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos:end])
                self.pos = end + 2
                return line
            self._fill()

    def _into(self, view: memoryview) -> None:
        """Fill `view` with the next bytes of the stream: what is buffered, then straight from the socket."""
        have = min(len(self.buf) - self.pos, len(view))
        view[:have] = self.buf[self.pos:self.pos + have]
        self.pos += have
        got = have
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the server closed the connection")
            got += n

    def _skip(self, count: int) -> None:
        scratch = memoryview(bytearray(min(count, 1 << 20)))
        while count:
            n = min(count, len(scratch))
            self._into(scratch[:n])
            count -= n

    def reply(self) -> Any:
        """The next reply: str for +status, int, bytes or None for bulk strings, a list for arrays; an error
        reply is returned as a ReplyError (not raised: the other replies of a pipeline must still be read)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = bytearray(n)
            self._into(memoryview(data))
            self._skip(2)
            return bytes(data)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise ConnectionError(f"unexpected reply from the server: {line[:40]!r}")

    def value_into(self, header: memoryview, page: memoryview) -> str:
        """Read a GET reply: "hit" (header and page filled), "nil", "size" (a value of another size, skipped) or
        "error"."""
        line = self._line()
        if line[:1] == b"-":
            return "error"
        if line[:1] != b"$":
            raise ConnectionError(f"unexpected reply to GET: {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return "nil"
        if n != len(header) + len(page):
            self._skip(n + 2)
            return "size"
        self._into(header)
        self._into(page)
        self._skip(2)
        return "hit"


def value_header(namespace: bytes, key: bytes, page: memoryview, page_bytes: int) -> bytes:
    """The 64-byte header stored before a page's bytes (see the module doc)."""
    digest = bound_checksum(namespace, key, checksum(page))
    return HEADER.pack(MAGIC, FORMAT_VERSION, 0, page_bytes, digest, key, namespace).ljust(HEADER_BYTES, b"\0")


def header_matches(namespace: bytes, key: bytes, header: Any, page: memoryview, page_bytes: int) -> bool:
    """Whether a value read back (header, page bytes) is this key's page of this namespace, intact."""
    magic, version, _flags, length, digest, got_key, got_namespace = HEADER.unpack_from(header)
    return (magic == MAGIC and version == FORMAT_VERSION and length == page_bytes and got_key == key
            and got_namespace == namespace and digest == bound_checksum(namespace, key, checksum(page)))


def _host_view(page: Any) -> memoryview:
    """A page buffer (a 1-D uint8 CPU tensor, or anything with the buffer protocol) as a writable memoryview."""
    if hasattr(page, "numpy"):
        page = page.numpy()
    return memoryview(page).cast("B")


class SharedStore:
    """What the shared tier's stores have in common (Valkey/Redis: `RemoteStore`; Mooncake:
    `tiers.mooncake.MooncakeStore`): the namespace, the admission rule, the counters, the state with its retry
    backoff, reads and writes cut into batches, probes and deletes counted. A store provides `address`,
    `_read_batch`, `_write_batch`, `_probe`, `_remove` and `close`, and its own connections; it logs under its own
    module's logger."""

    def __init__(self, namespace: bytes, page_bytes: int, batch_pages: int, admission_hits: int,
                 retry_min_s: float, retry_max_s: float) -> None:
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes")
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.batch_pages = max(1, min(batch_pages, BATCH_BYTES // max(1, page_bytes + HEADER_BYTES)))
        self.retry_min_s, self.retry_max_s = retry_min_s, retry_max_s
        self._admission = admission_policy(admission_hits)
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._state = "ok"
        self._why = ""
        self._retry_at = 0.0
        self._backoff = retry_min_s
        self._closed = False
        self._log = logging.getLogger(type(self).__module__)

    @property
    def state(self) -> str:
        return self._state

    def note_hit(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._admission.note(keys)

    def read_pages(self, keys: Sequence[bytes], out: Sequence[Any]) -> list[bool]:
        """Read each key's page into its buffer; True where the value was there and verified."""
        results = [False] * len(keys)
        for start in range(0, len(keys), self.batch_pages):
            self._read_batch(keys, out, start, min(len(keys), start + self.batch_pages), results)
        return results

    def write_pages(self, keys: Sequence[bytes], pages: Sequence[Any]) -> list[bool]:
        return self.write_pages_detailed(keys, pages)[0]

    def write_pages_detailed(self, keys: Sequence[bytes],
                             pages: Sequence[Any]) -> tuple[list[bool], list[str | None]]:
        """Store pages; per page True, or the reason it was refused: "not_admitted", "remote_full" (the server is
        out of memory and does not evict), "remote_down" (unreachable) or "failed"."""
        with self._lock:
            admitted = self._admission.admit(list(keys))
        results = [False] * len(keys)
        reasons: list[str | None] = ["not_admitted" if not ok else None for ok in admitted]
        todo = [i for i, ok in enumerate(admitted) if ok]
        for start in range(0, len(todo), self.batch_pages):
            self._write_batch(keys, pages, todo[start:start + self.batch_pages], results, reasons)
        with self._lock:
            self._admission.forget([keys[i] for i in todo if results[i]])
            self._counters["not_admitted"] += admitted.count(False)
        return results, reasons

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is in the store now; all False while the store is down."""
        if not keys:
            return []
        found = self._probe(keys)
        if found is None:
            return [False] * len(keys)
        with self._lock:
            self._counters["probes"] += len(keys)
            self._counters["probe_hits"] += sum(found)
        return found

    def delete(self, keys: Sequence[bytes], wait: bool = True) -> int:
        """Remove keys from the store (other servers lose them too): for pages this server knows are bad or were
        written only to be measured. Returns how many were there."""
        if not keys:
            return 0
        gone = self._remove(keys)
        with self._lock:
            self._counters["deletes"] += gone
        return gone

    def stats(self) -> dict:
        with self._lock:
            return {"url": str(self.address), "state": self._state, "reason": self._why,
                    "page_bytes": self.page_bytes, **self._counters}

    # ---- for the stores ----

    def _probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key whether the store has it; None if the store could not be asked."""
        raise NotImplementedError

    def _remove(self, keys: Sequence[bytes]) -> int:
        """Delete the keys; how many the store had (0 if it could not be asked)."""
        raise NotImplementedError

    def _read_batch(self, keys, out, start: int, end: int, results: list[bool]) -> None:
        raise NotImplementedError

    def _write_batch(self, keys, pages, batch: list[int], results: list[bool], reasons: list[str | None]) -> None:
        raise NotImplementedError

    def _count_reads(self, pages: int, outcomes: Counter[str]) -> None:
        """Count a batch's reads by outcome: "hit" (verified), "nil" (the key was gone), "bad" / "size" (a value that
        failed verification: logged), "error"."""
        with self._lock:
            c = self._counters
            c["reads"] += pages
            c["hits"] += outcomes["hit"]
            c["read_bytes"] += outcomes["hit"] * self.page_bytes
            c["vanished"] += outcomes["nil"]
            c["misses"] += pages - outcomes["hit"]
            c["bad_values"] += outcomes["bad"] + outcomes["size"]
            c["errors"] += outcomes["error"]
        if outcomes["bad"] + outcomes["size"]:
            self._log.error("remote tier %s: %d values failed verification (wrong header, size or checksum): "
                            "served as misses", self.address, outcomes["bad"] + outcomes["size"])

    def _count_writes(self, batch: list[int], results: list[bool], full: int = 0) -> None:
        with self._lock:
            ok = sum(results[i] for i in batch)
            self._counters["writes"] += ok
            self._counters["write_bytes"] += ok * self.page_bytes
            self._counters["full"] += full
            self._counters["write_refused"] += len(batch) - ok

    def _waiting_to_retry(self) -> bool:
        """Closed, or down with its next try not due yet (call with the lock held)."""
        return self._closed or (self._state != "ok" and time.monotonic() < self._retry_at)

    def _mark_up(self) -> None:
        """A connection worked: back to "ok" (logged once, counted, when the store was down; lock held)."""
        if self._state != "ok":
            self._log.warning("remote tier %s is back", self.address)
            self._counters["reconnects"] += 1
        self._state, self._why, self._backoff = "ok", "", self.retry_min_s

    def _report_startup(self) -> None:
        self._log.error("remote tier %s unavailable at startup (%s): serving without it, retrying in %.1f s",
                        self.address, self._why, self._backoff)

    def _fail(self, state: str, why: str) -> None:
        """The store is `state` ("down", "auth_failed") for `why`: answer at once until the backoff has passed."""
        with self._lock:
            first = self._state == "ok" or self._why != why
            self._state, self._why = state, why
            self._retry_at = time.monotonic() + self._backoff
            wait, self._backoff = self._backoff, min(self.retry_max_s, self._backoff * 2)
        if first:
            self._log.error("remote tier %s %s (%s): serving without it; retrying in %.1f s (backoff up to %.0f s)",
                            self.address,
                            "refused the credentials" if state == "auth_failed" else "is unreachable",
                            why, wait, self.retry_max_s)


class RemoteStore(SharedStore):
    """Pages in a Valkey/Redis server under this cache's namespace; thread-safe (one connection per thread)."""

    def __init__(self, url: str, namespace: bytes, page_bytes: int, username: str | None = None,
                 password: str | None = None, key_prefix: str = "hicache", timeout_s: float = 2.0,
                 connect_timeout_s: float = 1.0, batch_pages: int = 128, admission_hits: int = 0,
                 retry_min_s: float = 0.5, retry_max_s: float = 30.0) -> None:
        super().__init__(namespace, page_bytes, batch_pages, admission_hits, retry_min_s, retry_max_s)
        self.address = RemoteAddress.parse(url, username, password)
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._prefix = f"{key_prefix}:{namespace.hex()}:".encode()
        self._local = threading.local()
        self._connections: list[_Connection] = []
        self._generation = 0  # bumped when the store goes down: connections of an older generation are dropped
        if self._connection() is None:
            self._report_startup()

    # ---- public API ----

    def key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        replies = self._pipeline([_Connection.command(b"EXISTS", self.key(k)) for k in keys], len(keys))
        return None if replies is None else [r == 1 for r in replies]

    def _remove(self, keys: Sequence[bytes]) -> int:
        replies = self._pipeline([_Connection.command(b"DEL", self.key(k)) for k in keys], len(keys))
        return sum(r for r in replies if isinstance(r, int)) if replies else 0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._connections = self._connections, []
        for c in conns:
            c.close()

    # ---- internals ----

    def _read_batch(self, keys, out, start: int, end: int, results: list[bool]) -> None:
        commands = [part for i in range(start, end) for part in _Connection.command(b"GET", self.key(keys[i]))]
        conn = self._connection()
        if conn is None:
            return
        header = memoryview(bytearray(HEADER_BYTES))
        outcomes: Counter[str] = Counter()
        try:
            conn.send(commands)
            for i in range(start, end):
                page = _host_view(out[i])
                got = conn.value_into(header, page)
                if got == "hit":
                    got = "hit" if self._verify(keys[i], header, page) else "bad"
                outcomes[got] += 1
                results[i] = got == "hit"
        except (OSError, ValueError) as e:
            self._down(conn, f"read: {e}")
            return
        self._count_reads(end - start, outcomes)

    def _verify(self, key: bytes, header: memoryview, page: memoryview) -> bool:
        return header_matches(self.namespace, key, header, page, self.page_bytes)

    def _header(self, key: bytes, page: memoryview) -> bytes:
        return value_header(self.namespace, key, page, self.page_bytes)

    def _write_batch(self, keys, pages, batch: list[int], results: list[bool], reasons: list[str | None]) -> None:
        if not batch:
            return
        conn = self._connection()
        if conn is None:
            for i in batch:
                reasons[i] = "remote_down"
            return
        commands: list[bytes | memoryview] = []
        for i in batch:
            key = keys[i]
            if len(key) != KEY_BYTES:
                raise ValueError(f"page key must be {KEY_BYTES} bytes, got {len(key)}")
            page = _host_view(pages[i])
            if len(page) != self.page_bytes:
                raise ValueError(f"page must be {self.page_bytes} bytes, got {len(page)}")
            header = self._header(key, page)
            name = self.key(key)
            commands += [b"*3\r\n$3\r\nSET\r\n$%d\r\n" % len(name), name,
                         b"\r\n$%d\r\n" % (HEADER_BYTES + self.page_bytes), header, page, b"\r\n"]
        try:
            conn.send(commands)
            replies = [conn.reply() for _ in batch]
        except (OSError, ValueError) as e:
            self._down(conn, f"write: {e}")
            for i in batch:
                reasons[i] = "remote_down"
            return
        full = 0
        for i, r in zip(batch, replies):
            if r == "OK":
                results[i] = True
            elif isinstance(r, ReplyError) and str(r).startswith("OOM"):
                reasons[i] = "remote_full"
                full += 1
            else:
                reasons[i] = "failed"
        self._count_writes(batch, results, full)

    def _pipeline(self, commands: list[list[bytes]], count: int) -> list[Any] | None:
        conn = self._connection()
        if conn is None:
            return None
        try:
            conn.send([part for c in commands for part in c])
            return [conn.reply() for _ in range(count)]
        except (OSError, ValueError) as e:
            self._down(conn, str(e) or type(e).__name__)
            return None

    def _connection(self) -> _Connection | None:
        """This thread's connection; None while the store is down and its retry time has not come."""
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None and local.generation == self._generation:
            return conn
        if conn is not None:
            conn.close()
            local.conn = None
        with self._lock:
            if self._waiting_to_retry():
                return None
            generation = self._generation
        try:
            conn = _Connection(self.address, self.connect_timeout_s, self.timeout_s)
            self._handshake(conn)
        except ReplyError as e:
            conn.close()
            self._fail("auth_failed" if "WRONGPASS" in str(e) or "NOAUTH" in str(e) or "AUTH" in str(e)
                       else "down", str(e))
            return None
        except OSError as e:
            self._fail("down", str(e) or type(e).__name__)
            return None
        with self._lock:
            self._mark_up()
            self._connections.append(conn)
        local.conn, local.generation = conn, generation
        return conn

    def _handshake(self, conn: _Connection) -> None:
        a = self.address
        steps = []
        if a.password is not None:
            steps.append(_Connection.command(b"AUTH", *([a.username.encode()] if a.username else []),
                                             a.password.encode()))
        if a.db:
            steps.append(_Connection.command(b"SELECT", str(a.db).encode()))
        steps.append(_Connection.command(b"PING"))
        conn.send([part for s in steps for part in s])
        for _ in steps:
            r = conn.reply()
            if isinstance(r, ReplyError):
                raise r

    def _down(self, conn: _Connection, why: str) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            self._generation += 1
            self._counters["errors"] += 1
            if conn in self._connections:
                self._connections.remove(conn)
        self._fail("down", why)
