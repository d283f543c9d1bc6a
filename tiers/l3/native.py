"""A native loop for the L3's page I/O: a page read or written in pieces, each hashed as it moves, in one C call.

The Python loop (tiers/l3/io.py, `_read_fused`) makes 16 calls per 8 MiB page (a pread and a hash update per
1 MiB piece), each releasing and taking the interpreter lock again. With several I/O threads that lock is what
they wait for, and reads fell well short of a raw read, the more so with more threads. Here a page is one ctypes
call that holds no lock while it runs, and reads come close to raw (bench/RESULTS.md, 'L3 store vs raw
O_DIRECT').

The C source (tiers/l3/native_io.c) is built at install (setup.py, tiers/native.py). It needs nothing but libc:
the hash functions are libxxhash's, found by tiers/l3/format.py and handed to it as pointers, so the digests are
the same xxh3_64 the Python path computes. Copies through a tmpfs slab's mapping hash in the copy's own pass where
the CPU allows (tiers/l3/copy_hash.h; its digests are checked against libxxhash's in `load`). Where the library is
not built, there is no libxxhash, or $HICACHE_NATIVE=0, `load()` returns None (logged once) and the Python loop
runs.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiers import native
from tiers.l3 import format as l3_format

logger = logging.getLogger(__name__)

def _check(rc: int, what: str) -> None:
    """Raise the OSError a native call's -errno result names (0: success)."""
    if rc:
        code = -rc
        message = "short read (slab truncated?)" if code == errno.ENODATA else os.strerror(code)
        raise OSError(code, f"{what}: {message}")


class NativePageIO:
    """The compiled loop: `read(fd, address, length, offset, piece)` and `write(...)` return the xxh3_64 of the
    bytes moved, or raise OSError."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib: Any = lib  # its functions are attributes looked up at run time
        self.one_pass = False  # copies through a mapping hash in the copy's own pass (copy_hash.h); set by load()
        args = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_size_t,
                ctypes.POINTER(ctypes.c_uint64))
        for name in ("hicache_read_hashed", "hicache_write_hashed"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self._read, self._write = lib.hicache_read_hashed, lib.hicache_write_hashed
        lib.hicache_in_memory_fs.argtypes, lib.hicache_in_memory_fs.restype = (ctypes.c_int,), ctypes.c_int
        lib.hicache_map.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
        lib.hicache_map.restype = ctypes.c_int
        lib.hicache_unmap.argtypes, lib.hicache_unmap.restype = (ctypes.c_void_p, ctypes.c_size_t), ctypes.c_int
        lib.hicache_populate.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        lib.hicache_populate.restype = ctypes.c_int
        lib.hicache_touch.argtypes, lib.hicache_touch.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), None
        lib.hicache_copy_mapped_batch.argtypes = (
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
            ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int))
        lib.hicache_copy_mapped_batch.restype = None
        for name in ("hicache_read_mapped", "hicache_write_mapped"):
            fn = getattr(lib, name)
            fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_int64, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64))
            fn.restype = ctypes.c_int

    def read(self, fd: int, address: int, length: int, offset: int, piece: int) -> int:
        digest = ctypes.c_uint64()
        _check(self._read(fd, address, length, offset, piece, ctypes.byref(digest)), "L3 read")
        return digest.value

    def write(self, fd: int, address: int, length: int, offset: int, piece: int) -> int:
        digest = ctypes.c_uint64()
        _check(self._write(fd, address, length, offset, piece, ctypes.byref(digest)), "L3 write")
        return digest.value

    def in_memory(self, fd: int) -> bool:
        """Whether the file of `fd` lives in memory (tmpfs, ramfs, hugetlbfs); False where that cannot be told."""
        return bool(self.lib.hicache_in_memory_fs(fd) == 1)

    def map(self, fd: int, length: int, writable: bool) -> MappedFile:
        """A shared mapping of the file's first `length` bytes (`fd` open for writing if `writable`); OSError if the
        kernel refuses it."""
        address = ctypes.c_void_p()
        _check(self.lib.hicache_map(fd, length, int(writable), ctypes.byref(address)), "L3 slab mapping")
        assert address.value is not None  # hicache_map sets it or fails
        return MappedFile(self, address.value, length, fd, writable)


class MappedFile:
    """A shared mapping of a slab that lives in memory: `read` copies a page out of it and `write` into it, each
    hashing the page in the same C call (no system call per piece, the interpreter lock released). The file's own
    size is checked on every call, so a slab cut short gives an error, never SIGBUS.

    A fresh mapping takes a fault per 4 KiB page on first touch, which makes first-touch copies several times
    slower than copies once faulted. `populate` faults it in ahead, from the start: [0, `populated`) is done, and
    callers copy through the mapping only below that mark."""

    def __init__(self, io: NativePageIO, address: int, length: int, fd: int, writable: bool) -> None:
        self.io, self.address, self.length, self.fd, self.writable = io, address, length, fd, writable
        self.populated = 0
        self.method = ""  # how populate faults pages in: "madvise" (MADV_POPULATE_*) or "touch"
        self.stopped = False  # set by close: a populate in progress ends after its current chunk

    def populate(self, chunk: int = 64 << 20) -> None:
        """Fault the mapping in, `chunk` bytes a call, advancing `populated`; stops early on close or an error
        (logged: the pages past the mark then keep their other path)."""
        while self.populated < self.length and not self.stopped:
            n = min(chunk, self.length - self.populated)
            rc = self.io.lib.hicache_populate(self.address + self.populated, n, int(self.writable))
            self.method = "touch" if rc == 1 else "madvise"
            if rc < 0:
                logger.warning("L3 slab mapping: faulting it in stopped at %d of %d bytes (%s); pages past that "
                               "are read and written by pread/pwrite", self.populated, self.length, os.strerror(-rc))
                return
            self.populated += n

    def _copy(self, fn: Callable[..., int], what: str, address: int, length: int, offset: int, piece: int) -> int:
        if not self.address:
            raise OSError(errno.EBADF, f"{what}: the slab mapping is closed")
        digest = ctypes.c_uint64()
        _check(fn(self.address, self.length, self.fd, address, length, offset, piece, ctypes.byref(digest)),
                       what)
        return digest.value

    def read(self, address: int, length: int, offset: int, piece: int) -> int:
        return self._copy(self.io.lib.hicache_read_mapped, "L3 read", address, length, offset, piece)

    def write(self, address: int, length: int, offset: int, piece: int) -> int:
        if not self.writable:
            raise OSError(errno.EBADF, "L3 write: the slab mapping is read-only")
        return self._copy(self.io.lib.hicache_write_mapped, "L3 write", address, length, offset, piece)

    def batch(self, write: bool, addresses: Sequence[int], offsets: Sequence[int], length: int,
              piece: int) -> MappedBatch:
        """Pages to copy into (`write`) or out of the mapping, `length` bytes each, by any number of threads at
        once (`MappedBatch.run`)."""
        if not self.address:
            raise OSError(errno.EBADF, "L3 slab mapping is closed")
        if write and not self.writable:
            raise OSError(errno.EBADF, "L3 write: the slab mapping is read-only")
        return MappedBatch(self, write, addresses, offsets, length, piece)

    def close(self) -> None:
        """Unmap; the caller first stops and joins any thread running `populate` (see `stopped`)."""
        if self.address:
            self.io.lib.hicache_unmap(self.address, self.length)
            self.address = 0


class MappedBatch:
    """One call's pages through a mapping: every thread that calls `run` copies and hashes pages, taking the next
    one in C until none is left; `outcomes` then gives each page's (digest, None) or (None, OSError)."""

    def __init__(self, mapped: MappedFile, write: bool, addresses: Sequence[int], offsets: Sequence[int],
                 length: int, piece: int) -> None:
        n = len(addresses)
        self.mapped, self.write, self.n, self.length, self.piece = mapped, write, n, length, piece
        self.bufs = (ctypes.c_void_p * n)(*addresses)
        self.offsets = (ctypes.c_int64 * n)(*offsets)
        self.digests = (ctypes.c_uint64 * n)()
        self.rcs = (ctypes.c_int * n)()
        self.next = ctypes.c_int64(0)

    def run(self) -> None:
        m = self.mapped
        m.io.lib.hicache_copy_mapped_batch(m.address, m.length, m.fd, self.bufs, self.offsets, self.n, self.length,
                                           self.piece, int(self.write), ctypes.byref(self.next), self.digests,
                                           self.rcs)

    def outcomes(self) -> list[tuple[int | None, OSError | None]]:
        what = "L3 write" if self.write else "L3 read"
        out: list[tuple[int | None, OSError | None]] = []
        for digest, rc in zip(self.digests, self.rcs):
            try:
                _check(rc, what)
                out.append((digest, None))
            except OSError as e:
                out.append((None, e))
        return out


@functools.cache
def load() -> NativePageIO | None:
    """The native page loop, compiled and loaded once per process; None where it cannot be had (see the module
    doc)."""
    what = "L3 page I/O"
    lib = native.load(Path(__file__).parent, "_native_io", what)
    if lib is None:
        return None
    hash_lib = l3_format.stream_library()
    if hash_lib is None:
        logger.warning("%s: the Python loop, slower (no libxxhash with the streaming xxh3 to hand the native loop: "
                       "install libxxhash0)", what)
        return None
    lib.hicache_native_init.argtypes = (ctypes.c_void_p,) * 5
    def addr(fn: Any) -> int | None:
        return ctypes.cast(fn, ctypes.c_void_p).value

    if lib.hicache_native_init(addr(hash_lib.XXH3_createState), addr(hash_lib.XXH3_64bits_reset),
                               addr(hash_lib.update), addr(hash_lib.XXH3_64bits_digest),
                               addr(hash_lib.XXH3_freeState)):
        logger.warning("%s: the Python loop (the native one refused libxxhash's functions)", what)
        return None
    page_io = NativePageIO(lib)
    page_io.one_pass = _one_pass_copy(lib, hash_lib)
    return page_io


# Lengths that take each path of xxh3's long-input algorithm: the shortest it takes, one block, one block and a
# byte (a partial block of no whole stripe), several blocks and a partial stripe, a 1 MiB page and a tail.
ONE_PASS_CHECK_LENGTHS = (241, 1024, 1025, 4096 + 37, (1 << 20) + 13)


def one_pass_enabled() -> bool:
    """Whether copies through a slab mapping may hash in the copy's own pass ($HICACHE_ONE_PASS_COPY=0: they
    copy, then hash each piece with libxxhash, to compare the two or to test the piece loop)."""
    return os.environ.get("HICACHE_ONE_PASS_COPY", "1") != "0"


def _one_pass_copy(lib: Any, hash_lib: Any) -> bool:
    """Turn on the one-pass copy and hash of tiers/l3/copy_hash.h where the CPU has it, libxxhash hands over its
    default secret, and its digests and bytes equal libxxhash's and the source's at ONE_PASS_CHECK_LENGTHS, into
    an aligned destination (streamed stores) and a misaligned one. Off (logged) otherwise: pages then copy and
    hash in pieces, with the same digests."""
    lib.hicache_copy_hash_init.argtypes, lib.hicache_copy_hash_init.restype = (ctypes.c_void_p,), ctypes.c_int
    lib.hicache_copy_xxh3.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.POINTER(ctypes.c_uint64))
    lib.hicache_copy_xxh3.restype = ctypes.c_int
    generate = getattr(hash_lib, "XXH3_generateSecret_fromSeed", None)
    if not one_pass_enabled() or generate is None:
        lib.hicache_copy_hash_init(None)
        return False
    secret = (ctypes.c_ubyte * 192)()
    generate.argtypes, generate.restype = (ctypes.c_void_p, ctypes.c_uint64), None
    generate(secret, 0)  # seed 0 gives xxh3's default secret
    if not lib.hicache_copy_hash_init(secret):
        return False  # no AVX2 (or not x86-64): the piece loop, as fast as this CPU's libxxhash allows
    longest = max(ONE_PASS_CHECK_LENGTHS)
    source = np.random.default_rng(0).integers(0, 256, longest + 64, dtype=np.uint8)
    target = np.zeros(longest + 64, dtype=np.uint8)
    for length in ONE_PASS_CHECK_LENGTHS:
        for shift in (0, 7):  # 7: a destination off the 32-byte alignment the streamed stores need
            target[:] = 0
            digest = ctypes.c_uint64()
            rc = lib.hicache_copy_xxh3(target.ctypes.data + shift, source.ctypes.data, length,
                                       ctypes.byref(digest))
            if rc or digest.value != l3_format.checksum(source[:length]) \
                    or not np.array_equal(target[shift:shift + length], source[:length]):
                lib.hicache_copy_hash_init(None)
                logger.warning("L3 page I/O: the one-pass copy and hash disagrees with libxxhash at %d bytes; "
                               "pages copy, then hash in pieces", length)
                return False
    return True
