"""A preallocated slab file of fixed-size slots behind a 4 KiB header; owns the file descriptors."""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import replace

from tiers.l3.format import HEADER_BYTES, L3Error, SlabHeader

log = logging.getLogger(__name__)


def slab_path(directory: str, file_index: int = 0) -> str:
    """Path of slab file `file_index` in a store directory."""
    return os.path.join(directory, f"slab-{file_index:03d}.bin")


def read_header(path: str) -> SlabHeader:
    """Read and parse a slab header; FileNotFoundError if absent, ValueError if unreadable."""
    with open(path, "rb") as f:
        return SlabHeader.unpack(f.read(HEADER_BYTES))


def _allocate(fd: int, path: str, size: int) -> None:
    """Reserve `size` bytes: posix_fallocate, or ftruncate where the file system lacks it."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise L3Error(e.errno, f"{path}: not enough free space for a {size}-byte slab") from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise L3Error(e.errno, f"{path}: cannot allocate slab: {e.strerror}") from e
        os.ftruncate(fd, size)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_free_space(path: str, size: int) -> None:
    """L3Error naming both sizes unless the file system has room for a `size`-byte slab at `path` (counting the
    space of the file it replaces): a slab must not fill the disk that other processes write to."""
    try:
        replaced = os.stat(path).st_blocks * 512
    except FileNotFoundError:
        replaced = 0
    fs = os.statvfs(os.path.dirname(path) or ".")
    free = fs.f_bavail * fs.f_frsize + replaced
    if free < size:
        raise L3Error(errno.ENOSPC, f"{path}: not enough free space for the slab: it needs {size} bytes "
                                    f"({size / 2**30:.2f} GiB), the file system has {free} ({free / 2**30:.2f} GiB) "
                                    "free; lower the L3 size or free space")


def create_slab(path: str, header: SlabHeader) -> None:
    """Create (or replace) a slab file: header written, space allocated, all synced. Where that fails, no file is
    left behind (a partly allocated slab would hold disk space nothing uses)."""
    _check_free_space(path, header.file_bytes())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _allocate(fd, path, header.file_bytes())
        os.pwrite(fd, header.pack(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    _fsync_dir(os.path.dirname(path) or ".")


class SlabFile:
    """Open descriptors on one slab: `data_fd` (O_DIRECT unless refused) for slots, `meta_fd` for the header.

    `direct` says whether data_fd bypasses the page cache; the store syncs with fdatasync either way.
    """

    def __init__(self, path: str, header: SlabHeader, read_only: bool, want_direct: bool) -> None:
        self.path = path
        self.header = header
        self.read_only = read_only
        flags = os.O_RDONLY if read_only else os.O_RDWR
        self.meta_fd = os.open(path, flags)
        self.direct = False
        self.data_fd = -1
        if want_direct:
            try:
                self.data_fd = os.open(path, flags | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    os.close(self.meta_fd)
                    raise
                log.warning("%s: file system rejects O_DIRECT; using buffered I/O with fsync", path)
        if self.data_fd < 0:
            self.data_fd = os.open(path, flags)

    def size(self) -> int:
        """Current size of the file in bytes."""
        return os.fstat(self.meta_fd).st_size

    def slots_on_disk(self) -> int:
        """How many whole slots the file really holds (fewer than the header says if truncated)."""
        return max(0, min(self.header.slot_count, (self.size() - HEADER_BYTES) // self.header.slot_bytes))

    def ensure_size(self) -> None:
        """Re-extend a truncated file to the size its header declares."""
        if self.size() < self.header.file_bytes():
            _allocate(self.meta_fd, self.path, self.header.file_bytes())
            os.fsync(self.meta_fd)

    def resize(self, slot_count: int) -> None:
        """Change the slot count. Caller has already dropped index entries of slots >= slot_count.

        Growing: allocate first, then write the header; shrinking: header first, then truncate.
        A crash in between leaves a header that describes no more slots than the file has.
        """
        new = replace(self.header, slot_count=slot_count)
        if slot_count > self.header.slot_count:
            _allocate(self.meta_fd, self.path, new.file_bytes())
            os.fsync(self.meta_fd)
        os.pwrite(self.meta_fd, new.pack(), 0)
        os.fsync(self.meta_fd)
        if slot_count < self.header.slot_count:
            os.ftruncate(self.meta_fd, new.file_bytes())
            os.fsync(self.meta_fd)
        self.header = new

    def sync(self) -> None:
        """Make written slot data durable."""
        if self.direct:
            os.fdatasync(self.data_fd)
        else:
            os.fsync(self.data_fd)

    def close(self) -> None:
        for fd in (self.data_fd, self.meta_fd):
            if fd >= 0:
                os.close(fd)
        self.data_fd = self.meta_fd = -1
