"""Injected I/O errors, damaged files and bad input: clear errors or handled states, never garbage."""

from __future__ import annotations

import errno
import glob
import hashlib
import logging
import mmap
import os
import subprocess

import pytest
import torch
from l3_helpers import NAMESPACE, PYTHON, content, empty, key, subprocess_env

from tiers.l3 import L3Error, L3Store
from tiers.l3.format import HEADER_BYTES, bound_checksum, checksum
from tiers.l3.inspect import format_report, inspect_store


def _raise(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


class _FailingNative:
    """The native page loop (tiers/l3/native.py) with one direction failing as the patched syscall does."""

    def __init__(self, native, op: str, code: int) -> None:
        self._native, self._op, self._code = native, op, code

    def __getattr__(self, name):
        return getattr(self._native, name)

    def read(self, *args):
        if self._op == "read":
            raise OSError(self._code, os.strerror(self._code))
        return self._native.read(*args)

    def write(self, *args):
        if self._op == "write":
            raise OSError(self._code, os.strerror(self._code))
        return self._native.write(*args)


def _inject(monkeypatch, store: L3Store, op: str, code: int) -> None:
    """Make the store's `op` ("read" or "write") fail with `code` on both of its paths: the vectored syscalls, and
    the native loop that moves whole aligned pages (which page takes which depends on its buffer's alignment, so
    a fault injected in one path only would reach some pages and not others)."""
    monkeypatch.setattr(os, "pwritev" if op == "write" else "preadv", _raise(code))
    native = getattr(store._io, "native", None)
    if native is not None:
        monkeypatch.setattr(store._io, "native", _FailingNative(native, op, code))


def _write(store: L3Store, ids, page_bytes: int = 8192) -> list[bool]:
    keys = [key(i) for i in ids]
    return store.write_pages(keys, [content(k, page_bytes) for k in keys])


def _reads_back(store: L3Store, ids, page_bytes: int = 8192) -> list[bool]:
    keys = [key(i) for i in ids]
    out = empty(page_bytes, len(keys))
    ok = store.read_pages(keys, out)
    return [o and torch.equal(t, content(k, page_bytes)) for o, t, k in zip(ok, out, keys)]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_error_degrades_and_indexes_nothing(open_store, monkeypatch, code):
    store = open_store(degraded_retry_s=3600)
    assert all(_write(store, range(3)))
    _inject(monkeypatch, store, "write", code)
    assert _write(store, range(3, 6)) == [False] * 3
    stats = store.stats()
    assert stats["state"] == "degraded" and stats["write_errors"] == 3 and stats["pages"] == 3
    assert store.contains([key(i) for i in range(6)]) == [True] * 3 + [False] * 3
    monkeypatch.undo()
    assert _write(store, [7]) == [False]  # refused cheaply until the retry interval passes
    assert store.stats()["write_refused"] == 1
    assert _reads_back(store, range(3)) == [True] * 3  # reads keep working
    store.check_integrity()


def test_failed_sync_of_one_group_keeps_the_groups_before_it(open_store, monkeypatch):
    """Groups of one call are pipelined (a group syncs while the next writes): a failed fdatasync of the
    second group indexes neither it nor anything after it, and keeps the first."""
    store = open_store(pages=16, sync_batch_pages=2, degraded_retry_s=3600)
    real, calls = os.fdatasync, []

    def second_fails(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.EIO, "injected")
        return real(fd)

    monkeypatch.setattr(os, "fdatasync", second_fails)
    assert _write(store, range(7)) == [True, True] + [False] * 5
    stats = store.stats()
    assert stats["state"] == "degraded" and stats["pages"] == 2
    assert store.contains([key(i) for i in range(7)]) == [True] * 2 + [False] * 5
    assert _reads_back(store, range(2)) == [True, True]
    store.check_integrity()


def test_groups_of_one_call_all_land(open_store):
    store = open_store(pages=16, sync_batch_pages=3)
    assert all(_write(store, range(11)))
    assert store.stats()["fsyncs"] == 4
    assert _reads_back(store, range(11)) == [True] * 11
    store.check_integrity()


def test_degraded_store_recovers_after_a_successful_probe(open_store, monkeypatch):
    store = open_store(degraded_retry_s=0)
    monkeypatch.setattr(os, "fdatasync", _raise(errno.EIO))
    assert _write(store, [1, 2]) == [False, False]
    assert store.stats()["state"] == "degraded" and store.used_pages() == 0
    monkeypatch.undo()
    assert _write(store, [1, 2]) == [True, True]
    assert store.stats()["state"] == "ok"
    assert _reads_back(store, [1, 2]) == [True, True]
    store.check_integrity()


def test_degraded_state_is_cleared_by_reopen(tmp_path, monkeypatch):
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE, degraded_retry_s=3600) as store:
        _inject(monkeypatch, store, "write", errno.ENOSPC)
        assert _write(store, [1]) == [False]
        monkeypatch.undo()
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert store.stats()["state"] == "ok" and _write(store, [1]) == [True]


def test_read_error_is_a_miss_but_keeps_the_entry(open_store, monkeypatch):
    store = open_store()
    assert all(_write(store, [1]))
    _inject(monkeypatch, store, "read", errno.EIO)
    assert _reads_back(store, [1]) == [False]
    assert store.stats()["read_errors"] == 1
    monkeypatch.undo()
    assert _reads_back(store, [1]) == [True]


def _flip_byte(store_dir, slot: int, slot_bytes: int, at: int = 100) -> None:
    with open(os.path.join(store_dir, "slab-000.bin"), "r+b") as f:
        f.seek(HEADER_BYTES + slot * slot_bytes + at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_flipped_byte_is_a_counted_miss_and_the_entry_is_dropped(tmp_path, open_store, page_bytes):
    store = open_store(page_bytes)
    assert all(_write(store, [1, 2], page_bytes))
    slot = store._entries[key(1)].slot
    _flip_byte(tmp_path / "store", slot, store.stats()["slot_bytes"], at=page_bytes - 1)
    assert _reads_back(store, [1, 2], page_bytes) == [False, True]
    stats = store.stats()
    assert stats["checksum_failures"] == 1 and store.contains([key(1)]) == [False]
    store.close()
    with L3Store(tmp_path / "store", 16 * 16384, page_bytes, NAMESPACE) as again:
        assert again.contains([key(1), key(2)]) == [False, True]  # the drop was durable


def test_inspect_verify_exits_1_when_a_truncated_slab_lost_entries(tmp_path, capsys):
    from hicache.cli import main

    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert all(_write(store, range(4)))  # slots 0..3
    os.truncate(tmp_path / "s" / "slab-000.bin", HEADER_BYTES + 2 * 8192 + 100)
    capsys.readouterr()
    assert main(["l3", "inspect", "--l3-path", str(tmp_path / "s"), "--verify"]) == 1
    out = capsys.readouterr()
    assert "invalid entries 2" in out.out and "2 index entries are lost" in out.err
    assert main(["l3", "inspect", "--l3-path", str(tmp_path / "s")]) == 0  # without --verify nothing is checked


def test_truncated_slab_drops_entries_past_eof_on_open(tmp_path):
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert all(_write(store, range(4)))  # slots 0..3
    os.truncate(tmp_path / "s" / "slab-000.bin", HEADER_BYTES + 2 * 8192 + 100)
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert store.stats()["dropped_entries"] == 2
        assert _reads_back(store, range(4)) == [True, True, False, False]
        assert os.path.getsize(tmp_path / "s" / "slab-000.bin") == HEADER_BYTES + 8 * 8192  # re-extended
        assert all(_write(store, range(4, 10)))
        store.check_integrity()


def test_slab_truncated_while_open_is_a_short_read(tmp_path, open_store):
    store = open_store()
    assert all(_write(store, range(4)))
    os.truncate(tmp_path / "store" / "slab-000.bin", HEADER_BYTES + 2 * 8192 + 100)
    assert _reads_back(store, range(4)) == [True, True, False, False]
    assert store.stats()["short_reads"] == 2 and store.used_pages() == 2


def test_garbage_index_is_moved_aside_and_the_store_starts_clean(tmp_path):
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert all(_write(store, range(4)))
    with open(tmp_path / "s" / "index.lmdb", "wb") as f:
        f.write(os.urandom(64 * 1024))
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        stats = store.stats()
        assert stats["index_resets"] == 1 and stats["pages"] == 0
        assert _reads_back(store, range(4)) == [False] * 4
        assert all(_write(store, range(8)))
        assert _reads_back(store, range(8)) == [True] * 8
    assert len(glob.glob(str(tmp_path / "s" / "index.lmdb.corrupt-*"))) == 1


def test_unreadable_slab_header_discards_the_index_and_recreates(tmp_path):
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert all(_write(store, range(4)))
    with open(tmp_path / "s" / "slab-000.bin", "r+b") as f:
        f.write(b"NOTMAGIC")
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert store.stats()["index_resets"] == 1 and store.used_pages() == 0
        assert _reads_back(store, range(4)) == [False] * 4


def test_other_format_version_is_refused_untouched(tmp_path):
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert all(_write(store, range(2)))
    slab = tmp_path / "s" / "slab-000.bin"
    with open(slab, "r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(4, "little"))
    before = slab.read_bytes()
    with pytest.raises(L3Error, match="format version 99"):
        L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE)
    assert slab.read_bytes() == before


def test_wrong_namespace_or_page_bytes_is_an_error(tmp_path):
    L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE).close()
    with pytest.raises(L3Error, match="other settings") as err:
        L3Store(tmp_path / "s", 8 * 8192, 8192, bytes(16))
    assert str(tmp_path / "s") in str(err.value) and "cache.l3.path" in str(err.value)
    with pytest.raises(L3Error, match="page_bytes"):
        L3Store(tmp_path / "s", 8 * 8192, 4096, NAMESPACE)
    L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE).close()  # still fine, and not locked by failures


def test_a_store_of_other_settings_names_the_settings_that_differ(tmp_path):
    fields = {"model": "smollm2-135m-instruct", "dtype": "bfloat16", "page_size": 16}
    L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE, namespace_fields=fields).close()
    with pytest.raises(L3Error) as err:
        L3Store(tmp_path / "s", 8 * 8192, 8192, bytes(16), namespace_fields={**fields, "page_size": 64})
    message = str(err.value)
    assert "page_size 16 there, 64 here" in message and "model" not in message.split("settings:")[1].split(".")[0]
    assert f"remove {tmp_path / 's'} to start over" in message


def test_a_deleted_index_is_a_warning_naming_the_pages_lost(tmp_path, caplog):
    with L3Store(tmp_path / "s", 16 * 8192, 8192, NAMESPACE) as store:
        keys = [key(i) for i in range(6)]
        assert all(store.write_pages(keys, [content(k, 8192) for k in keys]))
    index = tmp_path / "s" / "index.lmdb"
    for part in (index.iterdir() if index.is_dir() else [index]):
        part.unlink()
    if index.is_dir():
        index.rmdir()
    with caplog.at_level("WARNING", logger="tiers.l3.store"):
        with L3Store(tmp_path / "s", 16 * 8192, 8192, NAMESPACE) as store:
            assert store.used_pages() == 0 and store.stats()["dropped_entries"] >= 6
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("index.lmdb) is missing" in m and "About" in m for m in warned), warned


def test_second_writer_gets_a_lock_error(tmp_path):
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE):
        with pytest.raises(L3Error, match="in use by another writer") as err:
            L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE)
        assert str(tmp_path / "s") in str(err.value)
    L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE).close()


def test_a_second_writer_is_refused_even_with_the_lock_file_deleted(tmp_path):
    """Deleting <dir>/lock under a running writer must not let a second writer in (another process, too)."""
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE):
        os.unlink(tmp_path / "s" / "lock")
        with pytest.raises(L3Error, match="in use by another writer"):
            L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE)
        code = ("import sys; from tiers.l3 import L3Store, L3Error\n"
                "try:\n    L3Store(sys.argv[1], 8 * 8192, 8192, bytes.fromhex(sys.argv[2]))\n"
                "except L3Error as e:\n    print('refused:', e)\n")
        out = subprocess.run([PYTHON, "-c", code, str(tmp_path / "s"), NAMESPACE.hex()], capture_output=True,
                             text=True, env=subprocess_env(), timeout=60)
        assert out.stdout.startswith("refused:") and "in use by another writer" in out.stdout, out.stdout + out.stderr
    L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE).close()  # free again once the first is closed


def test_bad_paths_are_clear_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(L3Error, match="not a directory"):
        L3Store(tmp_path / "file", 8 * 8192, 8192, NAMESPACE)
    with pytest.raises(L3Error, match="parent directory .* does not exist"):
        L3Store(tmp_path / "missing" / "s", 8 * 8192, 8192, NAMESPACE)
    with pytest.raises(L3Error, match="no L3 store here"):
        L3Store(tmp_path / "nothing", 8 * 8192, 8192, NAMESPACE, read_only=True)
    with pytest.raises(L3Error, match="holds no"):
        L3Store(tmp_path / "tiny", 100, 8192, NAMESPACE)
    if os.geteuid() != 0:  # root may write anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(L3Error, match="not writable"):
            L3Store(tmp_path / "ro", 8 * 8192, 8192, NAMESPACE)


def test_bad_batches_are_rejected(open_store):
    store = open_store()
    with pytest.raises(ValueError, match="16 bytes"):
        store.write_pages([b"short"], empty(8192))
    with pytest.raises(ValueError, match="8192 bytes"):
        store.write_pages([key(1)], empty(4096))
    with pytest.raises(ValueError, match="keys but"):
        store.read_pages([key(1), key(2)], empty(8192))


def _snapshot(directory) -> dict[str, tuple[int, str]]:
    return {name: (os.stat(os.path.join(directory, name)).st_mtime_ns,
                   hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest())
            for name in sorted(os.listdir(directory))}


def test_inspect_reports_and_verifies_without_modifying(tmp_path, page_bytes):
    with L3Store(tmp_path / "s", 16 * 16384, page_bytes, NAMESPACE) as store:
        assert all(_write(store, range(6), page_bytes))
        slot = store._entries[key(2)].slot
        slot_bytes = store.stats()["slot_bytes"]
    _flip_byte(tmp_path / "s", slot, slot_bytes)
    before = _snapshot(tmp_path / "s")
    report = inspect_store(tmp_path / "s", verify=True)
    assert _snapshot(tmp_path / "s") == before
    assert report["pages"] == 6 and report["page_bytes"] == page_bytes and report["format_version"] == 2
    assert report["namespaces"] == {NAMESPACE.hex(): 6}
    assert report["capacity_pages"] == 16 * 16384 // slot_bytes
    assert report["verify"] == {"good": 5, "bad": 1}
    assert report["io_backend"] in ("posix", "buffered")
    text = format_report(report)
    assert "5 good, 1 bad" in text and NAMESPACE.hex() in text
    with L3Store(tmp_path / "s", 16 * 16384, page_bytes, NAMESPACE) as store:  # inspect dropped nothing
        assert store.used_pages() == 6


def test_inspect_verify_exits_1_when_a_page_fails_and_0_when_all_pass(tmp_path, capsys):
    from hicache.cli import main

    with L3Store(tmp_path / "s", 16 * 16384, 8192, NAMESPACE) as store:
        assert all(_write(store, range(6)))
        slot_bytes = store.stats()["slot_bytes"]
        slots = [store._entries[key(i)].slot for i in (1, 4)]
    assert main(["l3", "inspect", "--l3-path", str(tmp_path / "s"), "--verify"]) == 0
    assert main(["l3", "inspect", "--l3-path", str(tmp_path / "s")]) == 0
    for slot in slots:
        _flip_byte(tmp_path / "s", slot, slot_bytes)
    capsys.readouterr()
    assert main(["l3", "inspect", "--l3-path", str(tmp_path / "s"), "--verify"]) == 1
    out = capsys.readouterr()
    assert "4 good, 2 bad" in out.out and "2 page(s) failed verification" in out.err
    assert main(["l3", "inspect", "--l3-path", str(tmp_path / "s"), "--verify", "--json"]) == 1
    assert main(["l3", "inspect", "--l3-path", str(tmp_path / "s")]) == 0  # without --verify nothing is checked


def test_inspect_works_from_another_process_while_a_writer_holds_the_store(tmp_path):
    script = "import sys; from tiers.l3.inspect import inspect_store; print(inspect_store(sys.argv[1], True))"
    with L3Store(tmp_path / "s", 8 * 8192, 8192, NAMESPACE) as store:
        assert all(_write(store, range(3)))
        done = subprocess.run([PYTHON, "-c", script, str(tmp_path / "s")], env=subprocess_env(),
                              capture_output=True, text=True, timeout=60)
        assert "'verify': {'good': 3, 'bad': 0}" in done.stdout, done.stderr


def test_a_record_moved_to_another_key_fails_verification_and_is_never_served(open_store, tmp_path):
    """Shuffle the (slot, checksum) values among the index records: every page must then fail, not be served under
    another key (the checksum covers namespace and key, not only the bytes)."""
    import lmdb

    from tiers.l3.format import IndexRecord, index_key

    store = open_store(pages=8)
    keys = [key(i) for i in range(4)]
    assert all(store.write_pages(keys, [content(k, 8192) for k in keys]))
    store.close()
    env = lmdb.open(str(tmp_path / "store" / "index.lmdb"), subdir=False, max_dbs=0)
    with env.begin(write=True) as txn:
        records = [IndexRecord.unpack(txn.get(index_key(NAMESPACE, k))) for k in keys]
        for k, record in zip(keys, records[1:] + records[:1]):  # each key takes the next key's slot and checksum
            txn.put(index_key(NAMESPACE, k), record.pack())
    env.close()
    reopened = open_store(pages=8)
    out = empty(8192, 4)
    assert reopened.contains(keys) == [True] * 4
    assert reopened.read_pages(keys, out) == [False] * 4
    assert reopened.stats()["checksum_failures"] == 4 and reopened.contains(keys) == [False] * 4


def test_many_bad_pages_make_one_log_line_and_are_all_counted(tmp_path, open_store, caplog):
    store = open_store(pages=16)
    ids = list(range(12))
    assert all(_write(store, ids))
    for i in ids[:10]:
        _flip_byte(tmp_path / "store", store._entries[key(i)].slot, store.stats()["slot_bytes"])
    with caplog.at_level(logging.ERROR, logger="tiers.l3.store"):
        assert _reads_back(store, ids) == [False] * 10 + [True, True]
        assert _reads_back(store, ids[:10]) == [False] * 10  # gone now: misses, nothing more to report
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "10 pages failed to read" in lines[0] and "10 checksum mismatches" in lines[0], lines
    assert store.stats()["checksum_failures"] == 10


def native_loop_or_skip(native):
    """The native page loop, built at install (setup.py): missing, it fails the test. Skipped only where the run
    turns it off on purpose ($HICACHE_NATIVE=0, to test the Python loop alone)."""
    if os.environ.get("HICACHE_NATIVE") == "0":
        pytest.skip("$HICACHE_NATIVE=0 turns the native L3 loop off")
    loop = native.load()
    assert loop is not None, "the native L3 loop did not load: is it built (pip install -e .) and libxxhash0 there?"
    return loop


def _aligned_pages(n: int, page_bytes: int) -> list[torch.Tensor]:
    """Pages in page-aligned memory, as the host pool's: the store moves them in hashed pieces (tiers/l3/io.py)."""
    flat = torch.frombuffer(mmap.mmap(-1, n * page_bytes), dtype=torch.uint8)
    return list(flat.view(n, page_bytes))


@pytest.mark.parametrize("loop", ["native", "python"])
def test_pieces_hashed_as_they_move_give_the_whole_page_checksum_and_catch_a_flip(tmp_path, loop):
    from tiers.l3 import io as l3io
    from tiers.l3 import native

    page_bytes = 2 * l3io.FUSED_PIECE_BYTES + 4096  # three pieces, the last one short
    store = L3Store(tmp_path / "store", 4 * page_bytes, page_bytes, NAMESPACE, io_backend="buffered")
    if loop == "python":
        store._io.native = None
    else:
        store._io.native = native_loop_or_skip(native)
    src = _aligned_pages(2, page_bytes)
    for i, page in enumerate(src):
        page.copy_(content(key(i), page_bytes))
    assert store._io._fused([0, 1], src)  # the path under test
    assert store.write_pages([key(0), key(1)], src) == [True, True]
    for i, page in enumerate(src):  # the stored checksum is that of the whole page
        assert store._entries[key(i)].checksum == bound_checksum(NAMESPACE, key(i), checksum(page.numpy()))
    out = _aligned_pages(2, page_bytes)
    assert store.read_pages([key(0), key(1)], out) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(src, out))
    _flip_byte(tmp_path / "store", store._entries[key(1)].slot, store.stats()["slot_bytes"],
               at=l3io.FUSED_PIECE_BYTES + 17)  # inside the second piece
    assert store.read_pages([key(0), key(1)], out) == [True, False]
    assert store.stats()["checksum_failures"] == 1
    store.close()


def test_a_slab_larger_than_the_free_space_is_refused_before_any_file_is_made(tmp_path, monkeypatch):
    real = os.statvfs
    free_bytes = 4 << 20

    class Small:
        def __init__(self, fs):
            self.f_frsize, self.f_bavail = 4096, free_bytes // 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Small(real(p)))
    with pytest.raises(L3Error, match=r"needs 8392704 bytes .* has 4194304 \(0.00 GiB\) free") as e:
        L3Store(tmp_path / "s", capacity_bytes=1024 * 8192, page_bytes=8192, namespace=NAMESPACE)
    assert e.value.errno == errno.ENOSPC
    assert not (tmp_path / "s" / "slab-000.bin").exists()


def test_a_failed_slab_allocation_leaves_no_file(tmp_path, monkeypatch):
    def fill_then_fail(fd, offset, size):
        os.ftruncate(fd, size // 2)  # part of the space taken, as a real posix_fallocate leaves it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", fill_then_fail)
    with pytest.raises(L3Error, match="not enough free space"):
        L3Store(tmp_path / "s", capacity_bytes=64 * 8192, page_bytes=8192, namespace=NAMESPACE)
    assert not (tmp_path / "s" / "slab-000.bin").exists()
