"""Store directory checks and the single-writer lock (an fcntl.flock on the directory, dropped by the kernel on
exit)."""

from __future__ import annotations

import errno
import fcntl
import os

from tiers.l3.format import L3Error

LOCK_NAME = "lock"


def prepare_directory(path: str, read_only: bool) -> None:
    """Check (writer: create if missing) the store directory; L3Error naming the path and reason otherwise.

    A missing directory is created when its parent exists and is writable; a missing parent is an error,
    so a typo in a mount point does not silently fill the root file system.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise L3Error(errno.ENOTDIR, f"{path}: L3 store path exists and is not a directory")
    if not os.path.exists(path):
        if read_only:
            raise L3Error(errno.ENOENT, f"{path}: no L3 store here (directory does not exist)")
        parent = os.path.dirname(path.rstrip("/")) or "."
        if not os.path.isdir(parent):
            raise L3Error(errno.ENOENT, f"{path}: parent directory {parent} does not exist")
        try:
            os.mkdir(path, 0o755)
        except OSError as e:
            raise L3Error(e.errno, f"{path}: cannot create L3 store directory: {e.strerror}") from e
    if not read_only and not os.access(path, os.W_OK | os.X_OK):
        raise L3Error(errno.EACCES, f"{path}: L3 store directory is not writable")


class WriterLock:
    """An exclusive, non-blocking flock on the store directory itself; the holder's pid is written to `<path>/lock`
    for whoever is refused.

    The lock is on the directory, not on a file in it: a file can be deleted under a running writer, and a second
    writer then locks a new file of the same name and writes beside the first. The directory cannot go without the
    store going with it."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_NAME)
        try:
            self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise L3Error(e.errno, f"{directory}: cannot open the store directory to lock it: {e.strerror}") from e
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(self.fd)
            self.fd = -1
            raise L3Error(errno.EBUSY, f"{directory}: L3 store is in use by another writer "
                                       f"(pid {self._holder()}; the lock is on the directory)") from e
        try:
            with open(self.path, "w") as f:
                f.write(f"{os.getpid()}\n")
        except OSError as e:  # the pid file is for messages only: the lock holds without it
            os.close(self.fd)
            self.fd = -1
            raise L3Error(e.errno, f"{self.path}: cannot write the lock's pid file: {e.strerror}") from e

    def _holder(self) -> str:
        try:
            with open(self.path) as f:
                return f.read(32).strip() or "unknown"
        except OSError:
            return "unknown"

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
