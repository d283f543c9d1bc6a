"""HicacheStorage through SGLang's own StorageBackendFactory (backend `dynamic`) over a real MHATokenToKVPoolHost:
the same answers as SGLang's HiCacheFile call for call, the in-place v1 calls in every layout, restarts, the cache
identity, salts, a full store, the shared tier; and where HiCacheFile serves flipped or swapped bytes,
HicacheStorage refuses them."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage import StorageBackendFactory

from hicache.config import ConfigError
from hicache.integrations.sglang import HicacheStorage
from tests.integrations.sglang_helpers import fill, host_pool, page_keys, storage_config
from tiers.l3.format import L3Error

DYNAMIC = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang", "class_name": "HicacheStorage",
           "interface_v1": 1}


def open_backend(pool, path=None, layout="page_first", size_gib=0.01, **config):
    extra = {**DYNAMIC, "size_gib": size_gib, **({"path": str(path)} if path is not None else {}),
             **config.pop("extra", {})}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, layout=layout, **config), pool)
    backend.register_mem_pool_host(pool)
    return backend


def open_file_backend(pool, path):
    backend = StorageBackendFactory.create_backend("file", storage_config({"file_storage_path": str(path)}), pool)
    backend.register_mem_pool_host(pool)
    return backend


def pages(pool, starts):
    return [pool.get_data_page(s).clone() for s in starts]


def test_the_factory_builds_it():
    pool = host_pool("page_first")
    backend = StorageBackendFactory.create_backend("dynamic", storage_config({**DYNAMIC, "remote": {
        "url": "redis://127.0.0.1:1"}}), pool)
    assert isinstance(backend, HicacheStorage)
    assert backend.chunks is None  # the store opens once SGLang registers its host pool


def test_same_answers_as_sglangs_file_backend(tmp_path):
    pool = host_pool("page_first")
    fill(pool, 1)
    ours, theirs = open_backend(pool, tmp_path / "hicache"), open_file_backend(pool, tmp_path / "file")
    try:
        stored = page_keys(5)
        values = pages(pool, range(0, 20, 4))
        assert ours.batch_set(stored, values) is theirs.batch_set(stored, values) is True
        assert ours.set(page_keys(1, 40)[0], values[0]) is theirs.set(page_keys(1, 40)[0], values[0]) is True
        probes = [page_keys(1, i)[0] for i in (0, 3, 7, 40, 4, 41)]
        assert [ours.exists(k) for k in probes] == [theirs.exists(k) for k in probes] == [
            True, True, False, True, True, False]
        for batch in ([*stored], [*stored[:2], page_keys(1, 9)[0], stored[3]], [page_keys(1, 9)[0]], []):
            assert ours.batch_exists(batch) == theirs.batch_exists(batch)
        assert ours.batch_exists(stored) == 5
        for key in (stored[2], page_keys(1, 9)[0]):
            mine = ours.get(key, pool.get_dummy_flat_data_page())
            other = theirs.get(key, pool.get_dummy_flat_data_page())
            assert (mine is None) == (other is None)
            if mine is not None:
                assert torch.equal(mine, other) and torch.equal(mine, values[2])
        got = ours.batch_get([stored[0], page_keys(1, 9)[0], stored[4]],
                             [pool.get_dummy_flat_data_page() for _ in range(3)])
        assert torch.equal(got[0], values[0]) and got[1] is None and torch.equal(got[2], values[4])
    finally:
        ours.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head", "layer_first"])
def test_v1_calls_move_pages_in_place_byte_exact(tmp_path, layout):
    pool = host_pool(layout)
    fill(pool, 2)
    backend = open_backend(pool, tmp_path, layout=layout)
    try:
        keys = page_keys(4)
        before = pages(pool, range(0, 16, 4))
        assert backend.batch_set_v1(keys, torch.arange(0, 16)) == [True] * 4
        assert backend.batch_exists(keys) == 4
        missing = page_keys(1, 77)
        assert backend.batch_get_v1([*keys[:2], *missing], torch.arange(32, 44)) == [True, True, False]
        assert torch.equal(pool.get_data_page(32), before[0]) and torch.equal(pool.get_data_page(36), before[1])
        assert backend.batch_get_v1(keys[2:], torch.arange(48, 56)) == [True, True]
        assert torch.equal(pool.get_data_page(48), before[2]) and torch.equal(pool.get_data_page(52), before[3])
        # the generic calls read what the in-place ones wrote
        assert torch.equal(backend.get(keys[3], pool.get_dummy_flat_data_page()), before[3])
    finally:
        backend.close()


def test_a_restart_serves_the_same_keys(tmp_path):
    pool = host_pool("page_first")
    fill(pool, 3)
    first = open_backend(pool, tmp_path)
    keys = page_keys(3)
    before = pages(pool, range(0, 12, 4))
    assert first.batch_set_v1(keys, torch.arange(0, 12)) == [True] * 3
    first.close()
    second = open_backend(pool, tmp_path)
    try:
        assert second.batch_exists(keys) == 3
        assert second.batch_get_v1(keys, torch.arange(64, 76)) == [True] * 3
        assert all(torch.equal(pool.get_data_page(64 + 4 * i), before[i]) for i in range(3))
    finally:
        second.close()


@pytest.mark.parametrize("change, field", [
    ({"model": "org/other"}, "model"),
    ({"layout": "page_first_direct"}, "layout"),
    ({"tp": (1, 2)}, "tp"),
])
def test_another_identity_never_reads_the_store(tmp_path, change, field):
    pool = host_pool("page_first")
    first = open_backend(pool, tmp_path)
    first.batch_set_v1(page_keys(2), torch.arange(0, 8))
    first.close()
    layout = change.pop("layout", "page_first")
    other_pool = host_pool(layout)
    if "tp" in change:  # a rank of a TP deployment keeps a store of its own, in its own directory
        backend = open_backend(other_pool, tmp_path, layout=layout, **change)
        try:
            assert backend.chunks.directory == os.path.join(str(tmp_path), "tp2-rank1")
            assert backend.batch_exists(page_keys(2)) == 0
        finally:
            backend.close()
        return
    with pytest.raises(L3Error, match=field):
        open_backend(other_pool, tmp_path, layout=layout, **change)


def test_a_salt_gets_keys_of_its_own(tmp_path):
    pool = host_pool("page_first")
    fill(pool, 4)
    backend = open_backend(pool, tmp_path)
    try:
        salted = HiCacheStorageExtraInfo(extra_info={"cache_salt": "tenant-a"})
        other = HiCacheStorageExtraInfo(extra_info={"cache_salt": "tenant-b"})
        keys = page_keys(2)
        assert backend.batch_set_v1(keys, torch.arange(0, 8), salted) == [True, True]
        assert backend.batch_exists(keys, salted) == 2
        assert backend.batch_exists(keys, other) == 0 and backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, torch.arange(40, 48), other) == [False, False]
    finally:
        backend.close()


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_flipped_bytes_that_the_file_backend_serves_are_refused(tmp_path):
    pool = host_pool("page_first")
    fill(pool, 5)
    keys = page_keys(3)
    values = pages(pool, [0, 4, 8])
    ours, theirs = open_backend(pool, tmp_path / "hicache"), open_file_backend(pool, tmp_path / "file")
    assert ours.batch_set(keys, values) and theirs.batch_set(keys, values)
    local = ours.chunks.local
    offset = local._header.slot_offset(local._entries[ours._keys(keys[1])[0]].slot) + 17
    ours.close()
    flip_byte(tmp_path / "hicache" / "slab-000.bin", offset)
    flip_byte(os.path.join(theirs.file_path, f"{keys[1]}{theirs.config_suffix}.bin"), 17)
    ours = open_backend(pool, tmp_path / "hicache")
    try:
        served = theirs.get(keys[1], pool.get_dummy_flat_data_page())
        assert served is not None and not torch.equal(served, values[1])  # wrong bytes, served as a hit
        assert ours.get(keys[1], pool.get_dummy_flat_data_page()) is None
        assert ours.batch_exists(keys) == 1  # the bad page is dropped: a prefetch stops before it
        assert torch.equal(ours.get(keys[2], pool.get_dummy_flat_data_page()), values[2])
    finally:
        ours.close()


def test_swapped_records_that_the_file_backend_serves_are_refused(tmp_path):
    pool = host_pool("page_first")
    fill(pool, 6)
    keys = page_keys(2)
    values = pages(pool, [0, 4])
    ours, theirs = open_backend(pool, tmp_path / "hicache"), open_file_backend(pool, tmp_path / "file")
    assert ours.batch_set(keys, values) and theirs.batch_set(keys, values)
    local = ours.chunks.local
    slots = [local._entries[ours._keys(k)[0]].slot for k in keys]
    offsets = [local._header.slot_offset(s) for s in slots]
    size = ours.chunks.chunk_bytes
    ours.close()
    with open(tmp_path / "hicache" / "slab-000.bin", "r+b") as f:  # the two K halves change places
        f.seek(offsets[0])
        a = f.read(size)
        f.seek(offsets[1])
        b = f.read(size)
        f.seek(offsets[0])
        f.write(b)
        f.seek(offsets[1])
        f.write(a)
    files = [os.path.join(theirs.file_path, f"{k}{theirs.config_suffix}.bin") for k in keys]
    shutil.move(files[0], files[0] + ".tmp")
    shutil.move(files[1], files[0])
    shutil.move(files[0] + ".tmp", files[1])
    ours = open_backend(pool, tmp_path / "hicache")
    try:
        served = theirs.get(keys[0], pool.get_dummy_flat_data_page())
        assert torch.equal(served, values[1])  # the other key's page, served as this one's
        assert ours.get(keys[0], pool.get_dummy_flat_data_page()) is None
        assert ours.get(keys[1], pool.get_dummy_flat_data_page()) is None
        assert ours.stats()["checksum_failures"] == 2
    finally:
        ours.close()


def test_a_full_store_evicts_and_keeps_working(tmp_path):
    pool = host_pool("page_first")
    fill(pool, 7)
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    backend = open_backend(pool, tmp_path, size_gib=8 * 4096 / (1 << 30))  # 8 slots: four pages of two halves
    try:
        assert page_bytes // 2 <= 4096
        for start in range(0, 40, 4):
            assert backend.batch_set_v1(page_keys(1, start), torch.arange(start, start + 4)) == [True]
        assert backend.chunks.store.used_pages() == 8
        newest = [page_keys(1, s)[0] for s in range(24, 40, 4)]
        assert backend.batch_exists(newest) == 4 and backend.batch_exists(page_keys(1, 0)) == 0
        assert backend.batch_get_v1(newest, torch.arange(80, 96)) == [True] * 4
        assert torch.equal(pool.get_data_page(92), pool.get_data_page(36))
    finally:
        backend.close()


def test_a_page_of_the_wrong_size_fails_alone_with_its_key_named(tmp_path, caplog):
    """A value of another size than the pool's pages is refused by itself, named in the log: passed on, the store
    would have refused the whole write batch, other callers' pages in it."""
    pool = host_pool("page_first")
    fill(pool, 3)
    backend = open_backend(pool, tmp_path)
    try:
        good, short, long = pages(pool, [0, 4, 8])
        keys = ["good", "short", "long"]
        assert backend.batch_set(keys, [good, short[: short.numel() // 2], torch.cat([long, long[:1]])]) is False
        assert backend.batch_exists(keys) == 1 and backend.exists("good") and not backend.exists("short")
        assert "HicacheStorage.set: page 'short'" in caplog.text and "page 'long'" in caplog.text
        got = backend.batch_get(["good", "good"], [torch.empty_like(good), torch.empty(3, dtype=good.dtype)])
        assert torch.equal(got[0], good) and got[1] is None
        assert "HicacheStorage.get: page 'good' is 6 bytes" in caplog.text
    finally:
        backend.close()


def test_the_shared_tier_serves_another_server(valkey, tmp_path):
    remote = {"remote": {"url": valkey.url, "key_prefix": f"sglang-test-{os.getpid()}"}}
    pool_a, pool_b = host_pool("page_first"), host_pool("page_first")
    fill(pool_a, 8)
    a = open_backend(pool_a, tmp_path / "a", extra=remote)
    b = open_backend(pool_b, None, extra=remote)
    try:
        keys = page_keys(3)
        assert a.batch_set_v1(keys, torch.arange(0, 12)) == [True] * 3
        assert b.batch_exists(keys) == 3
        assert b.batch_get_v1(keys, torch.arange(0, 12)) == [True] * 3
        assert all(torch.equal(pool_b.get_data_page(s), pool_a.get_data_page(s)) for s in (0, 4, 8))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("extra, message", [
    ({"size_gib": 1}, "give `path`"),
    ({"path": "/tmp/x", "size_gib": 1, "io_threads": 0}, "io_threads: must be > 0"),
    ({"path": "/tmp/x", "size_gib": 1, "file_storage_path": "/tmp"}, "unknown key 'file_storage_path'"),
])
def test_bad_options_name_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        HicacheStorage(storage_config({**DYNAMIC, **extra}))


def test_mla_across_ranks_needs_the_shared_tier(tmp_path):
    with pytest.raises(ConfigError, match="shared tier"):
        HicacheStorage(storage_config({**DYNAMIC, "path": str(tmp_path), "size_gib": 1}, mla=True, tp=(0, 2)))


def test_pages_the_admission_rule_skips_are_no_failed_backup(tmp_path):
    """With `admission_hits: 2` a page is stored at its second offer. The first `batch_set` stores nothing and still
    answers True: SGLang's backup stops the rest of an operation at a False, and a page skipped on purpose is no
    failure. A real failure still answers False."""
    pool = host_pool("page_first")
    fill(pool, 3)
    backend = open_backend(pool, tmp_path, extra={"admission_hits": 2})
    try:
        keys, values = page_keys(3), pages(pool, range(0, 12, 4))
        assert backend.batch_set(keys, values) is True
        assert backend.batch_exists(keys) == 0 and backend.chunks.store.stats()["not_admitted"] == 6
        assert backend.batch_set_v1(keys, torch.arange(0, 12)) == [True] * 3
        assert backend.batch_exists(keys) == 3
        assert backend.batch_get_v1(keys, torch.arange(20, 32)) == [True] * 3
        assert all(torch.equal(pool.get_data_page(20 + i), pool.get_data_page(i)) for i in range(0, 12, 4))
        store = backend.chunks.store
        store.write_pages_detailed = lambda ks, ps: ([False] * len(ks), ["failed"] * len(ks))  # an I/O error
        assert backend.batch_set(page_keys(1, 40), pages(pool, [40])) is False
    finally:
        backend.close()
