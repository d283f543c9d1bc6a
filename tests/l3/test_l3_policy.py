"""Capacity cap, LRU eviction order, admission, delete and capacity changes."""

from __future__ import annotations

import pytest
import torch
from l3_helpers import NAMESPACE, content, empty, key

from tiers.l3 import L3Store


def _write(store: L3Store, ids) -> list[bool]:
    keys = [key(i) for i in ids]
    return store.write_pages(keys, [content(k, 8192) for k in keys])


def _read(store: L3Store, ids) -> list[bool]:
    return store.read_pages([key(i) for i in ids], empty(8192, len(ids)))


def test_capacity_is_a_hard_cap_with_lru_eviction(open_store):
    store = open_store(pages=4)
    assert store.capacity_pages == 4
    assert all(_write(store, range(4)))
    assert _read(store, [0]) == [True]  # 0 is now the most recent; 1 is the least
    assert all(_write(store, [4]))
    assert store.contains([key(i) for i in range(5)]) == [True, False, True, True, True]
    assert all(_write(store, [5, 6]))
    assert store.contains([key(i) for i in range(7)]) == [True, False, False, False, True, True, True]
    stats = store.stats()
    assert stats["pages"] == store.used_pages() == 4 and stats["evictions"] == 3
    store.check_integrity()


def test_batch_larger_than_capacity_writes_what_fits(open_store):
    store = open_store(pages=3)
    assert _write(store, range(5)) == [True, True, True, False, False]
    assert store.stats()["no_slot"] == 2
    store.check_integrity()


def test_recency_survives_reopen(tmp_path):
    with L3Store(tmp_path / "s", 4 * 8192, 8192, NAMESPACE) as store:
        assert all(_write(store, range(4)))
        assert _read(store, [0, 1]) == [True, True]  # order now: 2, 3, 0, 1
    with L3Store(tmp_path / "s", 4 * 8192, 8192, NAMESPACE) as store:
        assert store.keys() == [key(i) for i in (2, 3, 0, 1)]
        assert all(_write(store, [4]))
        assert store.contains([key(2)]) == [False]


def test_rewriting_a_present_key_is_true_and_refreshes_it(open_store):
    store = open_store(pages=2)
    assert all(_write(store, [0, 1]))
    assert _write(store, [0]) == [True]
    assert store.stats()["already_present"] == 1 and store.stats()["writes"] == 2
    assert all(_write(store, [2]))
    assert store.contains([key(0), key(1)]) == [True, False]


def test_admission_needs_n_sightings(open_store):
    store = open_store(admission_hits=2)
    assert _write(store, [1]) == [False]
    assert store.stats()["not_admitted"] == 1 and store.used_pages() == 0
    assert _write(store, [1]) == [True]
    store.note_hit([key(2)])
    assert _write(store, [2, 3]) == [True, False]
    assert store.stats()["not_admitted"] == 2


def test_delete(open_store):
    store = open_store(pages=4)
    assert all(_write(store, range(4)))
    assert store.delete([key(1), key(1), key(9)]) == 1
    assert store.contains([key(1)]) == [False] and store.stats()["free_pages"] == 1
    assert all(_write(store, [5]))
    assert store.stats()["evictions"] == 0
    store.check_integrity()


def test_capacity_change_on_reopen(tmp_path):
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert all(_write(store, range(8)))
    with L3Store(tmp_path / "s", 4 * 8192, 8192, NAMESPACE) as store:  # shrink: pages in slots >= 4 go
        assert store.capacity_pages == 4 and store.used_pages() == 4
        out = empty(8192, 4)
        assert store.read_pages([key(i) for i in range(4)], out) == [True] * 4
        assert all(torch.equal(o, content(key(i), 8192)) for i, o in enumerate(out))
    with L3Store(tmp_path / "s", 16 * 8192, 8192, NAMESPACE) as store:  # grow
        assert store.capacity_pages == 16 and store.used_pages() == 4
        assert all(_write(store, range(10, 22)))
        store.check_integrity()


def test_an_access_time_touch_rewrites_only_that_slots_older_record(tmp_path):
    from tiers.l3.format import IndexRecord
    from tiers.l3.index import L3Index

    record = IndexRecord(slot=7, length=4096, checksum=0xABCDEF, last_access_ns=100)
    moved = IndexRecord.touched(record.pack(), 7, 250)
    assert moved is not None and IndexRecord.unpack(moved) == IndexRecord(7, 4096, 0xABCDEF, 250)
    assert IndexRecord.touched(record.pack(), 8, 250) is None  # the key now names another slot
    assert IndexRecord.touched(record.pack(), 7, 100) is None  # not more recent
    with pytest.raises(ValueError, match="record is 3 bytes"):
        IndexRecord.touched(b"abc", 7, 250)
    index = L3Index(str(tmp_path), 1 << 20, False)
    index.commit(puts=[(b"a" * 32, record.pack()), (b"b" * 32, record.pack())])
    # a's touch is newer; b's names another slot; c's key was deleted: only a's record changes
    index.commit(touches=[(b"a" * 32, 7, 300), (b"b" * 32, 9, 300), (b"c" * 32, 7, 300)])
    stored = dict(index.items())
    assert IndexRecord.unpack(stored[b"a" * 32]).last_access_ns == 300
    assert stored[b"b" * 32] == record.pack()
    assert b"c" * 32 not in stored
    index.close()
