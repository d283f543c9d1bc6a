"""On-disk format of the L3 page store: slab header, index key and index record (see docs/l3-format.md)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

FORMAT_VERSION = 2  # 2: a record's checksum covers its namespace and key as well as the page bytes
MAGIC = b"HICACHL3"
HEADER_BYTES = 4096  # the header block; slot 0 starts right after it
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers
KEY_BYTES = 16
NAMESPACE_BYTES = 16

# magic, version, header_bytes, namespace, page_bytes, slot_bytes, slot_count, file_index, reserved,
# created_ns
_HEADER = struct.Struct("<8sII16sQQQIIQ")
_HEADER_CHECKSUM = struct.Struct("<Q")  # xxh3_64 of the fields above, stored right after them
# version, flags, length, slot, checksum, last_access_ns
_RECORD = struct.Struct("<HHIQQQ")
RECORD_BYTES = _RECORD.size


class L3Error(OSError):
    """A store that cannot be opened or used; the message names the path and the reason."""


class VersionMismatch(ValueError):
    """A slab header written by another format version."""

    def __init__(self, version: int) -> None:
        super().__init__(f"format version {version}, this build reads version {FORMAT_VERSION}")
        self.version = version


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= value."""
    return (value + multiple - 1) // multiple * multiple


def slot_bytes_for(page_bytes: int) -> int:
    """Bytes one slot takes on disk: the page rounded up to the O_DIRECT alignment."""
    return round_up(page_bytes, ALIGN)


NATIVE_CHECKSUM_MIN_BYTES = 64 << 10  # below this, the Python binding's lower call cost wins


def _libxxhash() -> Any:  # a ctypes.CDLL: its functions are attributes looked up at run time
    """The system's libxxhash through ctypes, or None where there is none. ctypes releases the interpreter lock for
    each call, so hashing a page (0.1-0.2 ms for 8 MiB) does not stop the engine thread; the `xxhash` binding holds
    the lock while it hashes. Both compute the same xxh3_64 (seed 0). $HICACHE_LIBXXHASH names the library where
    the system's loader does not find one.

    Where the library was built with its x86 dispatcher (Debian's is), the `_dispatch` entry points pick the widest
    vector unit the CPU has at run time (AVX2, AVX-512); the plain ones are compiled for baseline x86-64 (SSE2).
    Same digests; the dispatched ones are more than twice as fast on an AVX-512 CPU."""
    name = os.environ.get("HICACHE_LIBXXHASH") or ctypes.util.find_library("xxhash")
    if name is None:
        return None
    try:
        lib: Any = ctypes.CDLL(name)
        lib.one_shot = getattr(lib, "XXH3_64bits_dispatch", None) or lib.XXH3_64bits
        lib.one_shot.restype = ctypes.c_uint64
        lib.one_shot.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    except (OSError, AttributeError):
        return None
    return lib


def _stream_api(lib: Any) -> Any:
    """lib with the prototypes of its streaming xxh3_64 set, or None where it lacks them."""
    if lib is None:
        return None
    try:
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = (ctypes.c_void_p,)
        lib.XXH3_64bits_reset.argtypes = (ctypes.c_void_p,)
        lib.update = getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update
        lib.update.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        lib.XXH3_64bits_digest.argtypes = (ctypes.c_void_p,)
        lib.XXH3_64bits_digest.restype = ctypes.c_uint64
    except AttributeError:
        return None
    return lib


_LIBXXHASH = _libxxhash()
_XXH3_64 = _LIBXXHASH.one_shot if _LIBXXHASH is not None else None


class _NativeStream:
    """Streaming xxh3_64 through libxxhash (the same digest as one call over the concatenated bytes)."""

    lib: Any = None

    def __init__(self) -> None:
        self.state = self.lib.XXH3_createState()
        self.lib.XXH3_64bits_reset(self.state)

    def update(self, buffer: Any) -> None:
        array = np.frombuffer(buffer, dtype=np.uint8)
        self.lib.update(self.state, array.ctypes.data, array.nbytes)

    def digest(self) -> int:
        return int(self.lib.XXH3_64bits_digest(self.state))

    def __del__(self) -> None:
        if getattr(self, "state", None):
            self.lib.XXH3_freeState(self.state)


_NativeStream.lib = _stream_api(_LIBXXHASH)


def stream_library() -> Any:
    """libxxhash with its streaming xxh3_64 prototypes set (`update` the dispatched update), or None."""
    return _NativeStream.lib


def checksum_stream() -> _NativeStream | _PythonStream:
    """An incremental xxh3_64: `update(buffer)` piece by piece, then `digest()`; equal to `checksum` of the whole.
    Hashing each piece of a page right after it was read (or right before it is written) reads it from the CPU's
    cache instead of a second pass over memory (tiers/l3/io.py)."""
    return _NativeStream() if _NativeStream.lib is not None else _PythonStream()


class _PythonStream:
    """The `xxhash` binding's streaming xxh3_64 (holds the interpreter lock while hashing)."""

    def __init__(self) -> None:
        self.h = xxhash.xxh3_64()

    def update(self, buffer: Any) -> None:
        self.h.update(buffer)

    def digest(self) -> int:
        return self.h.intdigest()


def bound_checksum(namespace: bytes, key: bytes, digest: int) -> int:
    """The checksum an index record stores: xxh3_64 of namespace + key + the page bytes' xxh3_64. A record moved
    to another key (or namespace) no longer verifies, so its bytes are never served under the wrong prompt."""
    return xxhash.xxh3_64_intdigest(namespace + key + digest.to_bytes(8, "little"))


def checksum(buffer: Any) -> int:
    """xxh3_64 of a buffer-protocol object (bytes, memoryview, numpy array)."""
    if _XXH3_64 is not None:
        array = np.frombuffer(buffer, dtype=np.uint8)
        if array.nbytes >= NATIVE_CHECKSUM_MIN_BYTES:
            return int(_XXH3_64(array.ctypes.data, array.nbytes))
    return xxhash.xxh3_64_intdigest(buffer)


@dataclass(frozen=True)
class SlabHeader:
    """The first 4 KiB of a slab file."""

    namespace: bytes
    page_bytes: int
    slot_bytes: int
    slot_count: int
    file_index: int = 0
    created_ns: int = 0
    version: int = FORMAT_VERSION

    def pack(self) -> bytes:
        """The full 4 KiB header block."""
        fields = _HEADER.pack(MAGIC, self.version, HEADER_BYTES, self.namespace, self.page_bytes,
                              self.slot_bytes, self.slot_count, self.file_index, 0, self.created_ns)
        block = fields + _HEADER_CHECKSUM.pack(checksum(fields))
        return block + bytes(HEADER_BYTES - len(block))

    @staticmethod
    def unpack(block: bytes) -> SlabHeader:
        """Parse a header block; raises ValueError naming what is wrong (magic, checksum, size)."""
        end = _HEADER.size + _HEADER_CHECKSUM.size
        if len(block) < end:
            raise ValueError(f"header is {len(block)} bytes, expected {HEADER_BYTES}")
        fields = block[:_HEADER.size]
        (magic, version, header_bytes, namespace, page_bytes, slot_bytes, slot_count, file_index, _,
         created) = _HEADER.unpack(fields)
        if magic != MAGIC:
            raise ValueError(f"bad magic {magic!r} (expected {MAGIC!r})")
        if version != FORMAT_VERSION:  # checked before the checksum: another version may sum differently
            raise VersionMismatch(version)
        (stored,) = _HEADER_CHECKSUM.unpack(block[_HEADER.size:end])
        if stored != checksum(fields):
            raise ValueError("header checksum mismatch")
        if header_bytes != HEADER_BYTES:
            raise ValueError(f"header size {header_bytes} (expected {HEADER_BYTES})")
        return SlabHeader(namespace, page_bytes, slot_bytes, slot_count, file_index, created, version)

    def slot_offset(self, slot: int) -> int:
        """Byte offset of a slot in the slab file."""
        return HEADER_BYTES + slot * self.slot_bytes

    def file_bytes(self) -> int:
        """Size of a complete slab file."""
        return HEADER_BYTES + self.slot_count * self.slot_bytes


def index_key(namespace: bytes, key: bytes) -> bytes:
    """LMDB key of a page: namespace (16 bytes) + page key (16 bytes)."""
    return namespace + key


@dataclass(frozen=True)
class IndexRecord:
    """LMDB value of a page: where it lives and how to verify it."""

    slot: int
    length: int
    checksum: int
    last_access_ns: int
    version: int = FORMAT_VERSION

    def pack(self) -> bytes:
        return _RECORD.pack(self.version, 0, self.length, self.slot, self.checksum, self.last_access_ns)

    @staticmethod
    def touched(value: bytes, slot: int, access_ns: int) -> bytes | None:
        """The record `value` with its access time moved up to access_ns, or None where it is not `slot`'s or
        already as recent (one struct unpack and pack: the index rewrites thousands of these per flush of access
        times); raises ValueError if it has the wrong size."""
        if len(value) != RECORD_BYTES:
            raise ValueError(f"record is {len(value)} bytes, expected {RECORD_BYTES}")
        version, pad, length, stored_slot, digest, access = _RECORD.unpack(value)
        if stored_slot != slot or access_ns <= access:
            return None
        return _RECORD.pack(version, pad, length, stored_slot, digest, access_ns)

    @staticmethod
    def unpack(value: bytes) -> IndexRecord:
        """Parse a record; raises ValueError if it has the wrong size."""
        if len(value) != RECORD_BYTES:
            raise ValueError(f"record is {len(value)} bytes, expected {RECORD_BYTES}")
        version, _, length, slot, digest, access = _RECORD.unpack(value)
        return IndexRecord(slot, length, digest, access, version)
