"""The remote tier on a Valkey or Redis server, one pool of prefixes for many hicache servers.

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
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

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

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValkeyAddress:
    host: str
    port: int
    db: int
    username: str | None
    password: str | None

    @classmethod
    def parse(cls, url: str, username: str | None = None, password: str | None = None) -> ValkeyAddress:
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

    def __init__(self, address: ValkeyAddress, connect_timeout_s: float, timeout_s: float) -> None:
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


class ValkeyStore(RemoteStore):
    """Pages in a Valkey/Redis server under this cache's namespace; thread-safe (one connection per thread)."""

    def __init__(self, url: str, namespace: bytes, page_bytes: int, username: str | None = None,
                 password: str | None = None, key_prefix: str = "hicache", timeout_s: float = 2.0,
                 connect_timeout_s: float = 1.0, batch_pages: int = 128, admission_hits: int = 0,
                 retry_min_s: float = 0.5, retry_max_s: float = 30.0) -> None:
        super().__init__(namespace, page_bytes, batch_pages, admission_hits, retry_min_s, retry_max_s)
        self.address: ValkeyAddress = ValkeyAddress.parse(url, username, password)
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

    def _read_batch(self, keys: Sequence[bytes], out: Sequence[Any], start: int, end: int,
                    results: list[bool]) -> None:
        commands = [part for i in range(start, end) for part in _Connection.command(b"GET", self.key(keys[i]))]
        conn = self._connection()
        if conn is None:
            return
        header = memoryview(bytearray(HEADER_BYTES))
        outcomes: Counter[str] = Counter()
        bad: list[bytes] = []
        try:
            conn.send(commands)
            for i in range(start, end):
                page = host_view(out[i])
                got = conn.value_into(header, page)
                if got == "hit":
                    got = "hit" if self._verify(keys[i], header, page) else "bad"
                outcomes[got] += 1
                results[i] = got == "hit"
                if got in ("bad", "size"):
                    bad.append(keys[i])
        except (OSError, ValueError) as e:
            self._down(conn, f"read: {e}")
            return
        self._count_reads(end - start, outcomes, bad)

    def _verify(self, key: bytes, header: memoryview, page: memoryview) -> bool:
        return header_matches(self.namespace, key, header, page, self.page_bytes)

    def _header(self, key: bytes, page: memoryview) -> bytes:
        return value_header(self.namespace, key, page, self.page_bytes)

    def _write_batch(self, keys: Sequence[bytes], pages: Sequence[Any], batch: list[int], results: list[bool],
                     reasons: list[str | None]) -> None:
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
            page = host_view(pages[i])
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

    def _pipeline(self, commands: list[list[bytes | memoryview]], count: int) -> list[Any] | None:
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
        conn: _Connection | None = getattr(local, "conn", None)
        if conn is not None and local.generation == self._generation:
            return conn
        if conn is not None:
            conn.close()
            local.conn = None
        with self._lock:
            if self._waiting_to_retry():
                return None
            generation = self._generation
        conn = None
        try:
            conn = _Connection(self.address, self.connect_timeout_s, self.timeout_s)
            self._handshake(conn)
        except ReplyError as e:
            if conn is not None:
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
