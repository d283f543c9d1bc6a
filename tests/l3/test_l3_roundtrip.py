"""Byte-exact round trips through every data path, across paths, across processes, across threads."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import threading

import pytest
import torch
from l3_helpers import NAMESPACE, PYTHON, content, empty, key, subprocess_env

from tiers.l3 import L3Store


@pytest.mark.parametrize("backend", ["posix", "buffered"])
def test_round_trip_is_byte_exact(open_store, page_bytes, backend):
    store = open_store(page_bytes, pages=40, io_backend=backend)
    assert store.io_backend == backend
    keys = [key(i) for i in range(37)]
    pages = [content(k, page_bytes) for k in keys]
    assert store.write_pages(keys, pages) == [True] * 37
    out = empty(page_bytes, 37)
    assert store.read_pages(keys, out) == [True] * 37
    for page, got in zip(pages, out):
        assert torch.equal(page, got)
    stats = store.stats()
    assert (stats["pages"], stats["hits"], stats["checksum_failures"]) == (37, 37, 0)
    assert stats["fsyncs"] == 2  # 37 pages, sync_batch_pages=32
    store.check_integrity()


def test_aligned_buffers_skip_the_bounce_buffer(open_store):
    """Tensors that are 4 KiB aligned (like a pinned host pool) are the O_DIRECT buffers themselves."""
    pool = mmap.mmap(-1, 8 * 8192)
    host = torch.frombuffer(pool, dtype=torch.uint8).view(8, 8192)
    store = open_store(8192, pages=8, io_backend="posix")
    keys = [key(i) for i in range(8)]
    for i, k in enumerate(keys):
        host[i].copy_(content(k, 8192))
    assert store.write_pages(keys, list(host)) == [True] * 8
    host.zero_()
    assert store.read_pages(keys, list(host)) == [True] * 8
    assert all(torch.equal(host[i], content(k, 8192)) for i, k in enumerate(keys))


def test_paths_read_each_others_bytes(tmp_path, page_bytes):
    keys = [key(i) for i in range(10)]
    capacity = 16 * 16384
    with L3Store(tmp_path / "s", capacity, page_bytes, NAMESPACE, io_backend="posix") as store:
        assert all(store.write_pages(keys[:5], [content(k, page_bytes) for k in keys[:5]]))
    with L3Store(tmp_path / "s", capacity, page_bytes, NAMESPACE, io_backend="buffered") as store:
        assert all(store.write_pages(keys[5:], [content(k, page_bytes) for k in keys[5:]]))
        out = empty(page_bytes, 10)
        assert store.read_pages(keys, out) == [True] * 10
    with L3Store(tmp_path / "s", capacity, page_bytes, NAMESPACE, io_backend="posix") as store:
        out2 = empty(page_bytes, 10)
        assert store.read_pages(keys, out2) == [True] * 10
    for a, b, k in zip(out, out2, keys):
        assert torch.equal(a, content(k, page_bytes)) and torch.equal(a, b)


def test_file_system_without_o_direct_falls_back_to_buffered(tmp_path, monkeypatch):
    """Like tmpfs on older kernels: open(O_DIRECT) fails with EINVAL."""
    real_open = os.open

    def open_without_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_without_direct)
    with L3Store(tmp_path / "s", 4 * 8192, 8192, NAMESPACE, io_backend="posix") as store:
        assert store.stats()["io_backend"] == "buffered"
        assert store.write_pages([key(1)], [content(key(1), 8192)]) == [True]
        out = empty(8192)
        assert store.read_pages([key(1)], out) == [True] and torch.equal(out[0], content(key(1), 8192))


def test_auto_picks_posix_without_cuda(open_store, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: auto may pick kvikio")
    from tiers.l3 import native

    loop = native.load()
    fd = os.open(tmp_path, os.O_RDONLY)
    in_memory = loop is not None and loop.in_memory(fd)  # a tmpfs /tmp: the slab is read through a mapping
    os.close(fd)
    assert open_store(8192, pages=2).stats()["io_backend"] == ("mapped" if in_memory else "posix")


@pytest.mark.cuda
def test_kvikio_round_trip_into_gpu_memory(tmp_path):
    pytest.importorskip("kvikio")
    keys = [key(i) for i in range(8)]
    pages = [content(k, 8192) for k in keys]
    with L3Store(tmp_path / "s", 16 * 8192, 8192, NAMESPACE, io_backend="kvikio") as store:
        assert store.io_backend == "kvikio"
        assert all(store.write_pages(keys, [p.cuda() for p in pages]))
        out = [torch.zeros(8192, dtype=torch.uint8, device="cuda") for _ in keys]
        assert all(store.read_pages(keys, out))
        assert all(torch.equal(o.cpu(), p) for o, p in zip(out, pages))
    with L3Store(tmp_path / "s", 16 * 8192, 8192, NAMESPACE, io_backend="posix") as store:
        out = empty(8192, 8)
        assert all(store.read_pages(keys, out))
        assert all(torch.equal(o, p) for o, p in zip(out, pages))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["posix", "kvikio"])
def test_round_trip_through_the_registered_host_pool(tmp_path, backend):
    """The host pool's memory (an mmap registered with CUDA, tiers/pinned.py) as the L3 store's buffers."""
    if backend == "kvikio":
        pytest.importorskip("kvikio")
    from tiers.pinned import pinned_empty

    host = pinned_empty((8, 8192), torch.uint8)
    assert host.is_pinned()
    keys = [key(i) for i in range(8)]
    for i, k in enumerate(keys):
        host[i].copy_(content(k, 8192))
    with L3Store(tmp_path / "s", 16 * 8192, 8192, NAMESPACE, io_backend=backend) as store:
        assert store.write_pages(keys, list(host)) == [True] * 8
        host.zero_()
        assert store.read_pages(keys, list(host)) == [True] * 8
    assert all(torch.equal(host[i], content(k, 8192)) for i, k in enumerate(keys))


READER = """
import sys, torch
from l3_helpers import NAMESPACE, content, empty, key
from tiers.l3 import L3Store
with L3Store(sys.argv[1], 64 * 16384, int(sys.argv[2]), NAMESPACE) as store:
    keys = [key(i) for i in range(20)]
    out = empty(int(sys.argv[2]), 20)
    ok = store.read_pages(keys, out)
    good = all(ok) and all(torch.equal(o, content(k, int(sys.argv[2]))) for o, k in zip(out, keys))
    assert store.write_pages([key(100)], [content(key(100), int(sys.argv[2]))]) == [True]
    print("OK" if good else f"BAD {ok}")
"""


def test_persists_across_processes(tmp_path, page_bytes):
    keys = [key(i) for i in range(20)]
    with L3Store(tmp_path / "s", 64 * 16384, page_bytes, NAMESPACE) as store:
        assert all(store.write_pages(keys, [content(k, page_bytes) for k in keys]))
    done = subprocess.run([PYTHON, "-c", READER, str(tmp_path / "s"), str(page_bytes)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "OK", done.stderr
    with L3Store(tmp_path / "s", 64 * 16384, page_bytes, NAMESPACE) as store:
        out = empty(page_bytes)
        assert store.read_pages([key(100)], out) == [True]
        assert torch.equal(out[0], content(key(100), page_bytes))
        assert store.used_pages() == 21


def test_concurrent_callers_never_see_wrong_bytes(open_store):
    store = open_store(8192, pages=24, io_threads=2)
    failures: list[str] = []

    def worker(seed: int) -> None:
        for step in range(40):
            ids = [(seed * 7 + step * 3 + j) % 40 for j in range(4)]
            keys = [key(i) for i in ids]
            if step % 3 == 0:
                store.write_pages(keys, [content(k, 8192) for k in keys])
            elif step % 3 == 1:
                out = empty(8192, 4)
                for ok, o, k in zip(store.read_pages(keys, out), out, keys):
                    if ok and not torch.equal(o, content(k, 8192)):
                        failures.append(k.hex())
            else:
                store.delete(keys[:1])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    stats = store.stats()
    assert stats["checksum_failures"] == 0 and stats["pages"] <= 24
    store.check_integrity()


def test_a_delete_that_does_not_wait_is_gone_at_once_and_durable_by_the_next_write(open_store, tmp_path):
    """delete(wait=False) (the engine thread's evictions): the pages are neither found nor read from then on; the
    index drop commits before the next write, and until then a crash only brings the pages back intact."""
    store = open_store(pages=4)
    keys = [key(i) for i in range(4)]
    assert all(store.write_pages(keys, [content(k, 8192) for k in keys]))
    commits = store.stats()["index_commits"]
    assert store.delete(keys[:2], wait=False) == 2
    assert store.stats()["index_commits"] == commits  # nothing written to the index on the caller's thread
    assert store.contains(keys) == [False, False, True, True]
    assert store.read_pages(keys[:1], empty(8192)) == [False]
    store._release()  # a crash: no flush, no commit
    reopened = open_store(pages=4)
    assert reopened.contains(keys) == [True] * 4  # the drop never committed: the pages came back, intact
    out = empty(8192, 4)
    assert reopened.read_pages(keys, out) == [True] * 4 and all(torch.equal(o, content(k, 8192)) for o, k in
                                                               zip(out, keys))
    assert reopened.delete(keys[:2], wait=False) == 2
    fresh = [key(i) for i in range(10, 12)]  # the store is full but for the two dropped slots: they are reused
    assert all(reopened.write_pages(fresh, [content(k, 8192) for k in fresh]))
    assert reopened.stats()["evictions"] == 0
    reopened.close()
    again = open_store(pages=4)
    assert again.contains(keys + fresh) == [False, False, True, True, True, True]


def test_write_pages_detailed_says_why_a_page_was_refused(open_store):
    store = open_store(pages=4, admission_hits=2)
    k = [key(1), key(2)]
    pages = [content(x, 8192) for x in k]
    assert store.write_pages_detailed(k, pages) == ([False, False], ["not_admitted", "not_admitted"])
    assert store.write_pages_detailed(k, pages) == ([True, True], [None, None])  # the second offer is admitted
    assert store.write_pages_detailed(k, pages) == ([True, True], [None, None])  # present: stored already
