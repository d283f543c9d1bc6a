"""The remote tier's common part: pages of many hicache servers in one shared store (Valkey or Redis:
tiers/remote/valkey.py; Mooncake: tiers/remote/mooncake.py).

A value is a 64-byte header then the page's bytes:

    magic "HCRP", format version (u16), flags (u16), page length (u64), checksum (u64), key (16 B), namespace (16 B)

the checksum being xxh3(namespace + key + xxh3(bytes)) as in the L3 (tiers/l3/format.py `bound_checksum`). A value
whose header or checksum does not match is a miss, counted (`bad_values`), never served. `RemoteStore` holds what
every backend shares: the header, the admission policy, the counters, the down/up state and its backoff.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

from tiers.l3.admission import admission_policy
from tiers.l3.entry import READ_FAILURE_LOG_S
from tiers.l3.format import NAMESPACE_BYTES, bound_checksum, checksum

logger = logging.getLogger(__name__)

MAGIC = b"HCRP"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQQ16s16s")
HEADER_BYTES = 64  # HEADER (56 bytes), zero-padded
BATCH_BYTES = 64 << 20  # pages per pipelined batch: at most `batch_pages`, and about this many bytes
COUNTERS = ("reads", "read_bytes", "hits", "misses", "vanished", "bad_values", "writes", "write_bytes",
            "write_refused", "not_admitted", "full", "probes", "probe_hits", "errors", "reconnects", "deletes",
            "bad_deleted")


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


def value_header(namespace: bytes, key: bytes, page: memoryview, page_bytes: int) -> bytes:
    """The 64-byte header stored before a page's bytes (see the module doc)."""
    digest = bound_checksum(namespace, key, checksum(page))
    return HEADER.pack(MAGIC, FORMAT_VERSION, 0, page_bytes, digest, key, namespace).ljust(HEADER_BYTES, b"\0")


def header_matches(namespace: bytes, key: bytes, header: Any, page: memoryview, page_bytes: int) -> bool:
    """Whether a value read back (header, page bytes) is this key's page of this namespace, intact."""
    magic, version, _flags, length, digest, got_key, got_namespace = HEADER.unpack_from(header)
    return bool(magic == MAGIC and version == FORMAT_VERSION and length == page_bytes and got_key == key
            and got_namespace == namespace and digest == bound_checksum(namespace, key, checksum(page)))


def host_view(page: Any) -> memoryview:
    """A page buffer (a 1-D uint8 CPU tensor, or anything with the buffer protocol) as a writable memoryview."""
    if hasattr(page, "numpy"):
        page = page.numpy()
    return memoryview(page).cast("B")


class RemoteStore:
    """What the remote tier's stores have in common (Valkey/Redis: `RemoteStore`; Mooncake:
    `tiers.mooncake.MooncakeStore`): the namespace, the admission rule, the counters, the state with its retry
    backoff, reads and writes cut into batches, probes and deletes counted. A store provides `address`,
    `_read_batch`, `_write_batch`, `_probe`, `_remove` and `close`, and its own connections; it logs under its own
    module's logger."""

    def __init__(self, namespace: bytes, page_bytes: int, batch_pages: int, admission_hits: int,
                 retry_min_s: float, retry_max_s: float) -> None:
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes")
        self.namespace = namespace
        self.address: object = None  # where the store is (set by each backend; str() is the URL without secrets)
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
        self._bad_unlogged = 0  # values that failed verification since the last log line
        self._bad_logged_at = -READ_FAILURE_LOG_S

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

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"url": str(self.address), "state": self._state, "reason": self._why,
                    "page_bytes": self.page_bytes, **self._counters}

    # ---- for the stores ----

    def close(self) -> None:
        """Drop the connections (each backend's)."""
        raise NotImplementedError

    def _probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key whether the store has it; None if the store could not be asked."""
        raise NotImplementedError

    def _remove(self, keys: Sequence[bytes]) -> int:
        """Delete the keys; how many the store had (0 if it could not be asked)."""
        raise NotImplementedError

    def _read_batch(self, keys: Sequence[bytes], out: Sequence[Any], start: int, end: int,
                    results: list[bool]) -> None:
        raise NotImplementedError

    def _write_batch(self, keys: Sequence[bytes], pages: Sequence[Any], batch: list[int], results: list[bool],
                     reasons: list[str | None]) -> None:
        raise NotImplementedError

    def _count_reads(self, pages: int, outcomes: Counter[str], bad: Sequence[bytes] = ()) -> None:
        """Count a batch's reads by outcome: "hit" (verified), "nil" (the key was gone), "bad" / "size" (a value that
        failed verification), "error". The keys of values that failed (`bad`) are deleted: no one can use them, and
        left in place every probe would find them and every read fetch them again. Failures are logged at most once
        per READ_FAILURE_LOG_S, with the count since the last line."""
        gone = self._remove(bad) if bad else 0
        now = time.monotonic()
        with self._lock:
            c = self._counters
            c["reads"] += pages
            c["hits"] += outcomes["hit"]
            c["read_bytes"] += outcomes["hit"] * self.page_bytes
            c["vanished"] += outcomes["nil"]
            c["misses"] += pages - outcomes["hit"]
            c["bad_values"] += outcomes["bad"] + outcomes["size"]
            c["bad_deleted"] += gone
            c["errors"] += outcomes["error"]
            self._bad_unlogged += outcomes["bad"] + outcomes["size"]
            report = self._bad_unlogged and now - self._bad_logged_at >= READ_FAILURE_LOG_S
            if report:
                count, self._bad_unlogged, self._bad_logged_at = self._bad_unlogged, 0, now
        if report:
            self._log.error("remote tier %s: %d values failed verification (wrong header, size or checksum): served "
                            "as misses and deleted (bad_values counts them; this line at most every %.0f s)",
                            self.address, count, READ_FAILURE_LOG_S)

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


