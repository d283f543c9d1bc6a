"""Byte stores of the KV cache: the GPU pool (L1), the pinned host pool (L2) and the L3 store.

Pools only allocate, free, read and write pages; which page holds what is the radix tree's business.

The torch-backed parts load on first use (PEP 562), so that what needs only the interfaces and the metadata pools
(the controller, the replay tool) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from tiers.base import KVLayout, PageAllocator, PagePool, PageStore
from tiers.copy import CompletedTransfer, LaunchLater, PageCopier, TransferHandle, make_copier
from tiers.metadata_pool import MetadataPool

_LAZY = {
    "DevicePool": "tiers.device_pool",
    "HostPool": "tiers.host_pool",
    "map_host_tensor": "tiers.pinned",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CompletedTransfer",
    "DevicePool",
    "HostPool",
    "KVLayout",
    "LaunchLater",
    "MetadataPool",
    "PageAllocator",
    "PageCopier",
    "PagePool",
    "PageStore",
    "TransferHandle",
    "make_copier",
    "map_host_tensor",
]
