"""hicache's disk tier holding another engine's KV chunks: the L3 store (tiers/l3), a remote tier (tiers/remote),
or both (tiers/persistent.py), opened under the engine's cache identity.

An engine names a chunk by its own key (vLLM: a block hash and a KV group; SGLang: a page hash string). The store's
page key is a 16-byte blake2b of that key, salted by the request's namespace where the engine passes one, and the
store's namespace fingerprints the cache identity: the engine, the model, the KV dtype, the chunk's bytes and
layout, and the parallel rank. Every record's checksum binds its bytes to that namespace and key
(docs/l3-format.md), so a chunk is served only to the identity and key that wrote it, and a server with another
configuration never reads this one's records: it is refused at open, naming the settings that differ.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from hicache.cache import REMOTE_PASSWORD_ENV
from hicache.config import ConfigError
from hicache.integrations.options import TierOptions
from radix import namespace_fingerprint, namespace_id
from radix.hashing import KEY_BYTES
from tiers.l3.format import slot_bytes_for
from tiers.l3.worker import Completion, L3Worker
from tiers.persistent import open_persistent

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# a page the store refused for one of these reasons was no failure of the tier: the admission rule skipped it on
# purpose, or another call is writing it (tiers/l3/store_write.py)
DELIBERATE_REFUSALS = ("not_admitted", "busy")


def chunk_key(engine_key: bytes, salt: str | None = None) -> bytes:
    """The store's 16-byte key of an engine's chunk key; a salt (a tenant, a request's cache salt) gives the
    chunk a key of its own, so that requests of one salt never find another salt's chunks."""
    seed = namespace_id(salt) if salt else b""
    return hashlib.blake2b(engine_key, digest_size=KEY_BYTES, key=seed, person=b"hicache-chunk").digest()


def store_directory(path: str, part: str | None) -> str:
    """Where one engine process's store lives: `path` itself, or `path/part` where several processes of one
    deployment (tensor-parallel ranks, data-parallel replicas) each keep their own (a store has one writer)."""
    return os.path.join(path, part) if part else path


class ChunkStore:
    """An engine's chunks of `chunk_bytes` each in hicache's disk tier, under the identity `identity` (a mapping of
    what changes the chunks' bytes). `part`: the sub-directory of this process's store, if any.

    `store` has the L3 store's interface (`contains`, `read_pages`, `write_pages_detailed`, `delete`, `stats`):
    pages are 1-D uint8 CPU tensors of `chunk_bytes`; reads verify each chunk's checksum and a failed one is a
    miss, counted and dropped, never served."""

    def __init__(self, options: TierOptions, chunk_bytes: int, identity: dict[str, Any], part: str | None = None,
                 source: str = "hicache tier") -> None:
        if chunk_bytes <= 0:
            raise ConfigError(f"{source}: the engine's chunks must have a positive size, got {chunk_bytes} bytes")
        self.options = options
        self.chunk_bytes = chunk_bytes
        self.fields = {**identity, "chunk_bytes": chunk_bytes}
        if options.namespace:
            self.fields["deployment"] = options.namespace
        self.namespace = namespace_fingerprint(self.fields)
        self.directory = store_directory(options.path, part) if options.path is not None else None
        store_args = remote_args = None
        if self.directory is not None:
            assert options.size_gib is not None  # TierOptions.check
            capacity = int(options.size_gib * _GIB) // slot_bytes_for(chunk_bytes) * slot_bytes_for(chunk_bytes)
            if capacity <= 0:
                raise ConfigError(f"{source}: size_gib: {options.size_gib} GiB holds no {chunk_bytes}-byte chunk")
            if part:
                os.makedirs(self.directory, exist_ok=True)
            store_args = dict(
                path=self.directory, capacity_bytes=capacity, page_bytes=chunk_bytes, namespace=self.namespace,
                namespace_fields=self.fields, io_backend=options.io_backend, io_threads=options.io_threads,
                sync_batch_pages=self.sync_batch_chunks,
                admission_hits=options.admission_hits, read_limit_bytes_per_s=options.read_limit_gbps * 1e9,
                write_limit_bytes_per_s=options.write_limit_gbps * 1e9)
        remote_pages = 0
        if options.remote is not None:
            r = options.remote
            remote_args = dict(url=r.url, namespace=self.namespace, page_bytes=chunk_bytes, username=r.username,
                               password=r.password or os.environ.get(REMOTE_PASSWORD_ENV) or None,
                               key_prefix=r.key_prefix, timeout_s=r.timeout_s, admission_hits=r.admission_hits)
            remote_pages = max(1, int(r.size_gib * _GIB) // chunk_bytes)
        self.store: Any = open_persistent(store_args, remote_args, remote_pages)
        self.store.track_evictions()
        self.local: Any = self.store if options.remote is None else self.store.local
        self.remote: Any = None if options.remote is None else self.store.remote
        logger.info("hicache tier: %s, %d-byte chunks, %s", self.directory or "no local store", chunk_bytes,
                    ", ".join(f"{k}={v}" for k, v in options.describe().items()))

    @property
    def sync_batch_chunks(self) -> int:
        return max(1, (self.options.sync_batch_mib << 20) // self.chunk_bytes)

    def contains_local(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the local store holds (its in-memory index: no I/O)."""
        return self.local.contains(keys) if self.local is not None else [False] * len(keys)

    def settle(self, timeout: float | None = None) -> bool:
        """Block until the local store's start-up work in the background is done (`L3Store.settle`)."""
        settle = getattr(self.local, "settle", None)
        return settle(timeout) if settle is not None else True

    def close(self) -> None:
        self.store.close()


class WaitedJobs:
    """A store's reads and writes for callers that wait for their own (SGLang calls its backend from threads of its
    own). Reads, and writes that meet no other write, run on the caller's thread (`L3Worker.read_now`,
    `write_now`): it would only wait for an I/O thread, and each hand-off between threads cost a small call more
    than its I/O (bench/RESULTS.md, 'Engine tiers against the engines' own'). A write that meets another goes to an
    L3Worker, so that concurrent callers' writes share its writer's synced batches (one fdatasync and index commit
    for many calls); its writer hands each completion straight to the caller's future."""

    def __init__(self, store: Any, queue_pages: int, batch_pages: int) -> None:
        self._waiting: dict[int, Future[Completion]] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        # its reader threads stay unused (reads run on the callers' threads)
        self.worker = L3Worker(store, threads=1, queue_pages=queue_pages, batch_pages=batch_pages,
                               on_complete=self._deliver)

    def write(self, keys: Sequence[bytes], pages: Sequence[Any]) -> list[bool]:
        """Store pages; True where stored, already present, or refused on purpose (`DELIBERATE_REFUSALS`), so that a
        caller that gives up at a failed page (SGLang's backup stops the rest of its pages there) does so only at a
        real failure. False for all when the write queue is full."""
        now = self.worker.write_now(keys, pages)
        if now is not None:
            return handled(*now)
        done: Future[Completion] = Future()
        with self._lock:
            token = next(self._tokens)
            self._waiting[token] = done
        if not self.worker.submit_write(token, keys, pages):
            with self._lock:
                self._waiting.pop(token)
            return [False] * len(keys)
        completion = done.result()
        return handled(completion.results, completion.reasons)

    def read(self, keys: Sequence[bytes], pages: Sequence[Any]) -> list[bool]:
        """Read pages into buffers; True where read and verified."""
        return self.worker.read_now(keys, pages)

    def close(self) -> None:
        """Finish the queued writes (their callers get their results), then stop."""
        self.worker.close()

    def _deliver(self, completion: Completion) -> None:
        with self._lock:
            done = self._waiting.pop(completion.token)
        done.set_result(completion)


def handled(results: Sequence[bool], reasons: Sequence[str | None]) -> list[bool]:
    """Per page: stored, or refused for one of `DELIBERATE_REFUSALS` (`reasons` may be empty: a store that gives
    none)."""
    why = list(reasons) or [None] * len(results)
    return [ok or reason in DELIBERATE_REFUSALS for ok, reason in zip(results, why)]


def byte_rows(view: memoryview) -> torch.Tensor:
    """A 2-D memoryview (rows of an engine's host memory) as a flat uint8 tensor over the same bytes (no copy)."""
    flat = view.cast("B") if view.ndim == 1 else view.cast("B", (view.nbytes,))
    return torch.frombuffer(flat, dtype=torch.uint8) if flat.nbytes else torch.empty(0, dtype=torch.uint8)
