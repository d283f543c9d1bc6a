"""The LMDB index of an L3 store: (namespace + page key) -> IndexRecord, one file `index.lmdb`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator

import lmdb

from tiers.l3.format import IndexRecord, L3Error

log = logging.getLogger(__name__)

INDEX_NAME = "index.lmdb"


def index_map_bytes(slot_count: int) -> int:
    """LMDB map size for `slot_count` entries: address space only, the file grows as needed."""
    return max(256 << 20, slot_count * 512)


class L3Index:
    """A single-file LMDB environment. Writes are whole transactions; LMDB syncs on commit."""

    def __init__(self, directory: str, map_bytes: int, read_only: bool) -> None:
        self.path = os.path.join(directory, INDEX_NAME)
        self.read_only = read_only
        if read_only:
            self.env = lmdb.open(self.path, subdir=False, readonly=True, lock=False, map_size=map_bytes)
        else:
            self.env = lmdb.open(self.path, subdir=False, map_size=map_bytes, sync=True, metasync=True,
                                 readahead=False, max_dbs=0)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) in key order; raises lmdb.Error if the file is damaged."""
        with self.env.begin(buffers=False) as txn:
            yield from txn.cursor()

    def count(self) -> int:
        return self.env.stat()["entries"]

    def commit(self, puts: Iterable[tuple[bytes, bytes]] = (), deletes: Iterable[bytes] = (),
               touches: Iterable[tuple[bytes, int, int]] = ()) -> None:
        """Apply deletes, puts and access-time touches in one durable transaction.

        A touch (key, slot, access_ns) rewrites the access time only if the key still maps to that slot,
        so a late touch never resurrects a deleted entry.
        """
        with self.env.begin(write=True) as txn:
            for key in deletes:
                txn.delete(key)
            for key, value in puts:
                txn.put(key, value)
            for key, slot, access_ns in touches:
                stored = txn.get(key)
                touched = None if stored is None else IndexRecord.touched(stored, slot, access_ns)
                if touched is not None:
                    txn.put(key, touched)

    def clear(self) -> None:
        """Delete every entry (durably)."""
        with self.env.begin(write=True) as txn:
            txn.drop(self.env.open_db(txn=txn), delete=False)

    def grow(self, map_bytes: int) -> None:
        if map_bytes > self.env.info()["map_size"]:
            self.env.set_mapsize(map_bytes)

    def close(self) -> None:
        self.env.close()


def move_aside(directory: str, reason: str) -> str:
    """Rename a damaged index to index.lmdb.corrupt-<ts> (and drop its lock file); returns the new path."""
    path = os.path.join(directory, INDEX_NAME)
    target = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}"
    os.rename(path, target)
    try:
        os.unlink(path + "-lock")
    except FileNotFoundError:
        pass
    log.error("%s: index unreadable (%s); moved to %s, starting with an empty index", path, reason, target)
    return target


def open_index(directory: str, map_bytes: int, read_only: bool) -> tuple[L3Index, int]:
    """Open the index, moving a damaged one aside (writer only). Returns (index, number of resets)."""
    path = os.path.join(directory, INDEX_NAME)
    try:
        index = L3Index(directory, map_bytes, read_only)
        try:
            for _ in index.items():  # a full walk touches every page, so damage shows up here
                pass
        except lmdb.Error:
            index.close()
            raise
        return index, 0
    except lmdb.Error as e:
        if read_only:
            raise L3Error(f"{path}: index unreadable: {e}") from e
        move_aside(directory, str(e))
        return L3Index(directory, map_bytes, read_only), 1
