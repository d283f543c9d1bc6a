"""The native L3 page loop (tiers/l3/native.py): the same digests and bytes as the Python loop, and named errors."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch
from test_l3_faults import NAMESPACE, _aligned_pages, content, key, native_loop_or_skip

from tiers.l3 import native
from tiers.l3.format import checksum
from tiers.l3.store import L3Store


@pytest.fixture
def loop():
    return native_loop_or_skip(native)


def test_a_page_moved_in_pieces_hashes_as_the_whole_of_it(loop, tmp_path):
    path = tmp_path / "data"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for length, piece in ((3 * 2**20 + 512, 2**20), (4096, 2**20), (2**20, 2**20), (70_000, 4096)):
            page = np.frombuffer(os.urandom(length), dtype=np.uint8).copy()
            digest = loop.write(fd, page.ctypes.data, length, 8192, piece)
            assert digest == checksum(memoryview(page))
            back = np.zeros_like(page)
            assert loop.read(fd, back.ctypes.data, length, 8192, piece) == digest
            assert np.array_equal(back, page)
    finally:
        os.close(fd)


def test_errors_are_named(loop, tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"x" * 10_000)
    fd = os.open(path, os.O_RDWR)
    buf = np.zeros(16_384, dtype=np.uint8)
    try:
        with pytest.raises(OSError, match="short read") as e:
            loop.read(fd, buf.ctypes.data, buf.nbytes, 0, 4096)  # the file ends inside the third piece
        assert e.value.errno == errno.ENODATA
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        loop.write(fd, buf.ctypes.data, buf.nbytes, 0, 4096)  # closed descriptor
    assert e.value.errno == errno.EBADF


@pytest.mark.parametrize("writer, reader", [("native", "python"), ("python", "native")])
def test_a_store_written_by_one_loop_reads_back_through_the_other(loop, tmp_path, writer, reader):
    page_bytes = 2**20 + 8192
    store = L3Store(tmp_path / "store", 8 * page_bytes, page_bytes, NAMESPACE, io_backend="buffered")
    store._io.native = loop if writer == "native" else None
    src = _aligned_pages(3, page_bytes)
    for i, page in enumerate(src):
        page.copy_(content(key(i), page_bytes))
    assert store.write_pages([key(i) for i in range(3)], src) == [True] * 3
    store._io.native = loop if reader == "native" else None
    out = _aligned_pages(3, page_bytes)
    assert store.read_pages([key(i) for i in range(3)], out) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(src, out))
    store.close()
