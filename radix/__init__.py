"""Radix index over token ids at page granularity; owns where every cached page lives.

Pure Python: no torch, no tier imports. Tiers are named by the constants in `radix.tree`.
"""

from radix.hashing import namespace_fingerprint, page_keys
from radix.namespace import DEFAULT_NAMESPACE, CacheNamespace, namespace_id
from radix.policy import EVICTION_POLICIES, eviction_priority
from radix.tree import DEVICE, DISK, HOST, TIERS, MatchResult, RadixTree, TreeNode

__all__ = [
    "DEFAULT_NAMESPACE",
    "DEVICE",
    "DISK",
    "EVICTION_POLICIES",
    "HOST",
    "CacheNamespace",
    "TIERS",
    "MatchResult",
    "RadixTree",
    "TreeNode",
    "eviction_priority",
    "namespace_fingerprint",
    "namespace_id",
    "page_keys",
]
