"""Byte stores of the KV cache: the GPU pool (L1), the pinned host pool (L2) and the L3 store.

Pools only allocate, free, read and write pages; which page holds what is the radix tree's business.
"""

from tiers.base import KVLayout, PageAllocator, PagePool, PageStore
from tiers.copy import CompletedTransfer, LaunchLater, PageCopier, TransferHandle, make_copier
from tiers.device_pool import DevicePool
from tiers.host_pool import HostPool
from tiers.metadata_pool import MetadataPool
from tiers.pinned import map_host_tensor

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
