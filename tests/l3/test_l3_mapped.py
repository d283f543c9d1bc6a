"""A slab that lives in memory is read and written through a shared mapping (tiers/l3/io.py, PosixSlotIO with
`map_reads`): the same digests and bytes as the pread path, and errors, not SIGBUS, for a slab cut short."""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import numpy as np
import pytest
import torch
from l3_helpers import NAMESPACE, content, empty, key
from test_l3_faults import native_loop_or_skip

from tiers.l3 import native
from tiers.l3.format import bound_checksum, checksum
from tiers.l3.io import PosixSlotIO
from tiers.l3.store import L3Store

PAGE = 3 * 2**18 + 4096  # not a whole number of pieces, and a slot padded past the page


@pytest.fixture
def loop():
    return native_loop_or_skip(native)


def mapped_store(path, pages: int = 8, page_bytes: int = PAGE) -> L3Store:
    """A store on any file system whose slab moves through a mapping, as one on tmpfs does."""
    store = L3Store(path, pages * (page_bytes + 8192), page_bytes, NAMESPACE, io_backend="buffered")
    plain, store._io = store._io, PosixSlotIO(store._slab, page_bytes, 2, 16 << 20, map_reads=True)
    plain.close()
    store._io._populating.join(30)  # faulted in: every slot moves through the mapping
    assert store._io.mapped.populated == store._io.mapped.length
    return store


def test_pages_round_trip_through_the_mapping_with_the_pread_paths_digests(loop, tmp_path):
    store = mapped_store(tmp_path / "s")
    assert store._io.name == "mapped" and store._io.mapped.writable  # the slab is allocated: writes map too
    keys = [key(i) for i in range(5)]
    pages = [content(k, PAGE) for k in keys]
    assert store.write_pages(keys, pages) == [True] * 5
    slots = [store._entries[k].slot for k in keys]
    assert [store._entries[k].checksum for k in keys] == [
        bound_checksum(NAMESPACE, k, checksum(memoryview(p.numpy()))) for k, p in zip(keys, pages)]
    out = empty(PAGE, 5)
    assert store.read_pages(keys, out) == [True] * 5
    assert all(torch.equal(a, b) for a, b in zip(pages, out))
    # the bytes are in the file where pread finds them: the plain path reads what the mapping wrote
    plain = PosixSlotIO(store._slab, PAGE, 2, 16 << 20, map_reads=False)
    again = empty(PAGE, 5)
    results = plain.read(slots, again)
    plain.close()
    assert [r.digest for r in results] == [checksum(memoryview(p.numpy())) for p in pages]
    assert all(torch.equal(a, b) for a, b in zip(pages, again))
    store.close()


def test_slots_past_the_faulted_in_mark_keep_pread_and_pwrite(loop, tmp_path, monkeypatch):
    store = mapped_store(tmp_path / "s", pages=4)
    io = store._io
    calls = []
    for name in ("read", "write"):
        real = getattr(io.mapped, name)
        monkeypatch.setattr(io.mapped, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    real_batch = io.mapped.batch  # a whole call's pages in one batch: each page counted

    def batch(write, addresses, *rest):
        calls.extend(["write" if write else "read"] * len(addresses))
        return real_batch(write, addresses, *rest)

    monkeypatch.setattr(io.mapped, "batch", batch)
    keys = [key(i) for i in range(4)]
    io.mapped.populated = 0  # as while the thread is still at the start
    assert store.write_pages(keys[:2], [content(k, PAGE) for k in keys[:2]]) == [True] * 2
    assert store.read_pages(keys[:2], out := empty(PAGE, 2)) == [True] * 2 and calls == []
    assert all(torch.equal(o, content(k, PAGE)) for o, k in zip(out, keys[:2]))
    io.mapped.populated = io.mapped.length
    assert store.write_pages(keys[2:], [content(k, PAGE) for k in keys[2:]]) == [True] * 2
    assert store.read_pages(keys, out := empty(PAGE, 4)) == [True] * 4  # pread-written pages read mapped too
    assert calls == ["write", "write", "read", "read", "read", "read"]
    assert all(torch.equal(o, content(k, PAGE)) for o, k in zip(out, keys))
    store.close()


def test_populate_stops_at_close(loop, tmp_path):
    path = tmp_path / "big"
    size = 64 << 20
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mapping = loop.map(fd, size, writable=True)
        mapping.stopped = True
        mapping.populate(chunk=1 << 20)
        assert mapping.populated == 0
        mapping.stopped = False
        mapping.populate(chunk=1 << 20)
        assert mapping.populated == size
        mapping.close()
    finally:
        os.close(fd)


def test_faulting_in_by_touch_changes_no_byte_while_another_thread_writes(loop, tmp_path):
    """The fallback where the kernel refuses MADV_POPULATE_WRITE adds zero to a byte of every 4 KiB page, atomically:
    bytes already there and bytes a copy writes meanwhile both survive it."""
    path = tmp_path / "slab"
    size = 16 << 20
    before = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    path.write_bytes(before.tobytes())
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = loop.map(fd, size, writable=True)
        assert loop.lib.hicache_populate(mapping.address, 1 << 20, 1) in (0, 1)  # 0: the advice, 1: the touch
        # the second half is rewritten by a copy while a touch walks the whole mapping
        after = before.copy()
        after[size // 2:] = 255 - before[size // 2:]
        src = torch.from_numpy(after[size // 2:].copy())

        def copy() -> None:
            for at in range(0, size // 2, 1 << 16):
                ctypes.memmove(mapping.address + size // 2 + at, src.data_ptr() + at, 1 << 16)

        writer = threading.Thread(target=copy)
        writer.start()
        for _ in range(4):
            loop.lib.hicache_touch(mapping.address, size, 1)
        writer.join()
        mapping.close()
    finally:
        os.close(fd)
    assert np.array_equal(np.frombuffer(path.read_bytes(), dtype=np.uint8), after)


def test_a_corrupted_byte_is_a_miss(loop, tmp_path):
    store = mapped_store(tmp_path / "s")
    assert store.write_pages([key(1)], [content(key(1), PAGE)]) == [True]
    offset = store._slab.header.slot_offset(store._entries[key(1)].slot) + 1000
    fd = os.open(store._slab.path, os.O_RDWR)
    os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x40]), offset)
    os.close(fd)
    assert store.read_pages([key(1)], empty(PAGE)) == [False]
    assert store.stats()["checksum_failures"] == 1
    store.close()


def test_a_slab_cut_short_gives_a_named_error_not_sigbus(loop, tmp_path):
    io_path = tmp_path / "s"
    store = mapped_store(io_path, pages=4)
    keys = [key(i) for i in range(4)]
    assert store.write_pages(keys, [content(k, PAGE) for k in keys]) == [True] * 4
    slots = {k: store._entries[k].slot for k in keys}
    last = max(keys, key=slots.get)
    os.truncate(store._slab.path, store._slab.header.slot_offset(slots[last]) + 4096)  # inside the last slot
    results = store._io.read([slots[last]], empty(PAGE))
    assert isinstance(results[0].error, OSError) and results[0].error.errno == errno.ENODATA
    assert "short read" in str(results[0].error)
    results = store._io.write([slots[last]], [content(last, PAGE)])  # writing there would fault too
    assert results[0].error is not None and results[0].error.errno == errno.ENODATA
    first = min(keys, key=slots.get)
    assert store.read_pages([first], out := empty(PAGE)) == [True]  # slots still inside the file read as ever
    assert torch.equal(out[0], content(first, PAGE))
    store.close()


def test_one_call_through_the_mapping_reports_each_page_on_its_own(loop, tmp_path):
    """A call's pages go through the mapping as one batch that several threads work through: a page past the end of
    a slab cut short fails by itself, with its own error, and the others of the same call read their bytes."""
    store = mapped_store(tmp_path / "s", pages=8)
    keys = [key(i) for i in range(8)]
    assert store.write_pages(keys, [content(k, PAGE) for k in keys]) == [True] * 8
    slots = [store._entries[k].slot for k in keys]
    cut = sorted(slots)[5]
    os.truncate(store._slab.path, store._slab.header.slot_offset(cut))  # slots from the sixth on are gone
    out = empty(PAGE, 8)
    results = store._io.read(slots, out)
    for k, slot, r, o in zip(keys, slots, results, out):
        if slot < cut:
            assert r.error is None and r.digest == checksum(memoryview(content(k, PAGE).numpy()))
            assert torch.equal(o, content(k, PAGE))
        else:
            assert isinstance(r.error, OSError) and r.error.errno == errno.ENODATA and r.digest is None
    assert sum(r.error is None for r in results) == 5
    store.close()


def test_close_waits_for_a_copy_through_the_mapping_and_refuses_later_ones(loop, tmp_path, monkeypatch):
    """Unmapping under a copy would crash the process: close waits for the calls in flight, also one that runs in
    its caller's thread (a single page), and later calls get an error instead."""
    store = mapped_store(tmp_path / "s", pages=2)
    io = store._io
    k = key(0)
    assert store.write_pages([k], [content(k, PAGE)]) == [True]
    slot = store._entries[k].slot
    inside, go_on = threading.Event(), threading.Event()
    real_batch = io.mapped.batch

    def slow_batch(*args):
        batch = real_batch(*args)
        run = batch.run

        def held_run():
            inside.set()
            assert go_on.wait(30)
            run()

        batch.run = held_run
        return batch

    monkeypatch.setattr(io.mapped, "batch", slow_batch)
    out = empty(PAGE)
    results = []
    reader = threading.Thread(target=lambda: results.extend(io.read([slot], out)))
    reader.start()
    assert inside.wait(30)
    closer = threading.Thread(target=io.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and io.mapped.address  # still mapped: the read is inside its copy
    go_on.set()
    reader.join(30)
    closer.join(30)
    assert not closer.is_alive() and io.mapped.address == 0
    assert results[0].error is None and torch.equal(out[0], content(k, PAGE))
    with pytest.raises(OSError) as e:
        io.read([slot], empty(PAGE))
    assert e.value.errno == errno.EBADF and "closed" in str(e.value)
    store._io = None  # closed above
    store._release()


def test_a_sparse_slab_is_written_by_pwrite_and_read_through_the_mapping(loop, tmp_path):
    path = tmp_path / "sparse"
    size = 16 * 4096
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)  # no blocks: a write fault on a full tmpfs would raise SIGBUS
    try:
        mapping = loop.map(fd, size, writable=os.fstat(fd).st_blocks * 512 >= size)
        assert not mapping.writable
        with pytest.raises(OSError, match="read-only"):
            mapping.write(0, 4096, 0, 4096)
        page = np.frombuffer(os.urandom(8192), dtype=np.uint8).copy()
        os.pwrite(fd, page.tobytes(), 4096)
        back = np.zeros_like(page)
        assert mapping.read(back.ctypes.data, 8192, 4096, 4096) == checksum(memoryview(page))
        assert np.array_equal(back, page)
        with pytest.raises(OSError) as e:
            mapping.read(back.ctypes.data, 8192, size - 4096, 4096)  # past the end of the mapping
        assert e.value.errno == errno.ENODATA
        mapping.close()
        with pytest.raises(OSError, match="closed"):
            mapping.read(back.ctypes.data, 8192, 0, 4096)
    finally:
        os.close(fd)


def test_forced_mapping_without_the_native_loop_is_refused(tmp_path, monkeypatch):
    store = L3Store(tmp_path / "s", 4 * (PAGE + 8192), PAGE, NAMESPACE, io_backend="buffered")
    monkeypatch.setattr(native, "load", lambda: None)
    with pytest.raises(OSError, match="need the native page loop"):
        PosixSlotIO(store._slab, PAGE, 2, 16 << 20, map_reads=True)
    store.close()


def _memory_dir() -> str | None:
    """/dev/shm where it is a tmpfs (the kernel's view, not its name)."""
    try:
        with open("/proc/mounts") as mounts:
            return "/dev/shm" if any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts) else None
    except OSError:
        return None


@pytest.mark.skipif(_memory_dir() is None, reason="no tmpfs at /dev/shm on this machine")
def test_auto_maps_a_slab_on_tmpfs_and_posix_does_not(loop):
    import tempfile

    for backend, want in (("auto", "mapped"), ("posix", ("posix", "buffered"))):
        with tempfile.TemporaryDirectory(dir=_memory_dir()) as directory:
            with L3Store(directory, 4 * (PAGE + 8192), PAGE, NAMESPACE, io_backend=backend) as store:
                assert store.io_backend in want
                assert store.stats()["io_backend"] == store.io_backend
                assert store.write_pages([key(3)], [content(key(3), PAGE)]) == [True]
                assert store.read_pages([key(3)], out := empty(PAGE)) == [True]
                assert torch.equal(out[0], content(key(3), PAGE))


def test_a_mapped_call_takes_helpers_only_for_bytes_worth_a_hand_off_and_within_io_threads(loop, tmp_path,
                                                                                           monkeypatch):
    from tiers.l3 import io as l3_io

    page = 1 << 20
    store = mapped_store(tmp_path / "s", pages=16, page_bytes=page)
    io = store._io
    io.io_threads = 4
    helpers: list[int] = []
    submit = io.pool.submit

    def counted(fn, *args):
        helpers[-1] += 1
        return submit(fn, *args)

    monkeypatch.setattr(io.pool, "submit", counted)
    monkeypatch.setattr(l3_io, "MAPPED_HELPER_BYTES", 4 * page)
    keys = [key(i) for i in range(16)]
    pages = [content(k, page) for k in keys]

    def write(count: int) -> None:
        helpers.append(0)
        assert store.write_pages(keys[:count], pages[:count]) == [True] * count
        helpers.append(0)
        out = empty(page, count)  # what the threads shared out comes back whole
        assert store.read_pages(keys[:count], out) == [True] * count
        assert all(torch.equal(a, b) for a, b in zip(pages, out))
        store.delete(keys[:count])

    write(2)  # 2 MiB: less than one helper's share, the caller copies alone
    write(8)  # 8 MiB: the caller and one helper
    write(16)  # 16 MiB: three helpers, the caller the fourth of io_threads
    io._copying = 3  # three other threads copying: one slot left, the caller's own
    write(16)
    io._copying = 0
    assert helpers == [0, 0, 1, 1, 3, 3, 0, 0]  # each write's, then its read's
    store.close()


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx2" in line for line in f)


def test_the_one_pass_copy_hashes_as_libxxhash_and_moves_every_byte(loop):
    """copy_hash.h's xxh3_64 against libxxhash's, across the lengths where its blocks, stripes and tail change, into
    aligned (streamed) and misaligned destinations, from misaligned sources; on where the CPU has AVX2."""
    assert loop.one_pass == (os.uname().machine == "x86_64" and _cpu_has_avx2()
                             and native.one_pass_enabled())
    if not loop.one_pass:
        pytest.skip("no one-pass copy on this CPU or with $HICACHE_ONE_PASS_COPY=0")
    source = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    target = np.zeros(3 << 20, dtype=np.uint8)
    lengths = [241, 255, 256, 319, 320, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 4096, 65536 + 1,
               (2 << 20) - 64, 2 << 20, (2 << 20) + 63]
    for length in lengths:
        for src_shift, dst_shift in ((0, 0), (3, 0), (0, 32), (5, 17)):
            target[:] = 0
            digest = ctypes.c_uint64()
            assert loop.lib.hicache_copy_xxh3(target.ctypes.data + dst_shift, source.ctypes.data + src_shift,
                                              length, ctypes.byref(digest)) == 0
            assert digest.value == checksum(source[src_shift:src_shift + length]), (length, src_shift, dst_shift)
            assert np.array_equal(target[dst_shift:dst_shift + length], source[src_shift:src_shift + length])
            assert not target[:dst_shift].any() and not target[dst_shift + length:].any()  # nothing else written
    digest = ctypes.c_uint64()
    assert loop.lib.hicache_copy_xxh3(None, source.ctypes.data, 5000, ctypes.byref(digest)) == 0  # hash only
    assert digest.value == checksum(source[:5000])
    assert loop.lib.hicache_copy_xxh3(None, source.ctypes.data, 240, ctypes.byref(digest)) == -errno.EINVAL


def test_pages_written_in_one_pass_read_back_in_pieces_and_the_reverse(loop, tmp_path):
    """The one-pass copy and the piece loop write the same records: each reads the other's pages, verified."""
    if not loop.one_pass:
        pytest.skip("no one-pass copy on this CPU")
    store = mapped_store(tmp_path / "s")
    keys = [key(i) for i in range(4)]
    pages = [content(k, PAGE) for k in keys]
    try:
        assert store.write_pages(keys[:2], pages[:2]) == [True] * 2  # one pass
        loop.lib.hicache_copy_hash_init(None)
        assert store.write_pages(keys[2:], pages[2:]) == [True] * 2  # in pieces
        out = empty(PAGE, 4)
        assert store.read_pages(keys, out) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(pages, out))
    finally:
        assert native._one_pass_copy(loop.lib, native.l3_format.stream_library())
    out = empty(PAGE, 4)
    assert store.read_pages(keys, out) == [True] * 4  # one pass again, every record
    assert all(torch.equal(a, b) for a, b in zip(pages, out))
    store.close()
