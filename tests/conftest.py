"""Shared fixtures: a tiny KV layout."""

from __future__ import annotations

import pytest

from tiers import KVLayout


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, itemsize=4)
