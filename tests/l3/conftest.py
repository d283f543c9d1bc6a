"""Fixtures for the L3 store tests: small pages, deterministic content per key."""

from __future__ import annotations

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from l3_helpers import NAMESPACE  # noqa: E402

from tiers.l3 import L3Store  # noqa: E402


@pytest.fixture(params=[8192, 12 * 1024 + 1], ids=["8KiB", "12KiB+1"])
def page_bytes(request) -> int:
    return request.param


@pytest.fixture
def open_store(tmp_path):
    """Factory: open an L3Store under tmp_path/store (closed at teardown)."""
    stores: list[L3Store] = []

    def make(page_bytes: int = 8192, pages: int = 16, **kwargs) -> L3Store:
        kwargs.setdefault("namespace", NAMESPACE)
        path = kwargs.pop("path", tmp_path / "store")
        store = L3Store(path, pages * ((page_bytes + 4095) // 4096 * 4096), page_bytes, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
