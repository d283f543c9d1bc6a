"""Eviction policies as priority functions of a node: the lowest priority is evicted first."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radix.node import TreeNode


def _lru(node: TreeNode) -> Any:
    return node.last_access


def _lfu(node: TreeNode) -> Any:
    return (node.hit_count, node.last_access)


def _lrfu(half_life: float) -> Callable[[TreeNode], Any]:
    """Decayed frequency: a node's references, each weighing half as much every `half_life` ticks, compared at
    one common time. log2(frequency decayed to now) = log2(frequency) - (now - last_access) / half_life, and
    `now` is the same for every node, so the rank is the static key below."""
    def priority(node: TreeNode) -> float:
        return node.last_access / half_life + math.log2(max(node.frequency, 1e-300))
    return priority


DEFAULT_HALF_LIFE = 1024.0  # ticks of the tree's clock (one per prefix lookup and one per commit)
EVICTION_POLICIES = ("lru", "lfu", "lrfu")


def tier_policies(name: str) -> tuple[str, str, str]:
    """The priority function names a policy uses for the device, host and disk tiers.

    "lrfu" ranks the memory tiers by decayed frequency and the disk by recency. Replays (bench/RESULTS.md): on a
    multi-turn trace whose conversations outgrow GPU + host memory, LRU evicts each conversation just before it
    comes back; frequency keeps a stable share of them in memory. On the Mooncake trace, frequency on the disk
    tier held on to old blocks and lost disk hits, while recency did not.
    """
    if name == "lrfu":
        return ("lrfu", "lrfu", "lru")
    eviction_priority(name)  # a clear error for an unknown name
    return (name, name, name)


def eviction_priority(name: str, half_life: float = DEFAULT_HALF_LIFE) -> Callable[[TreeNode], Any]:
    """The priority function of policy `name`; raises ValueError listing the choices."""
    if name == "lru":
        return _lru
    if name == "lfu":
        return _lfu
    if name == "lrfu":
        return _lrfu(half_life)
    raise ValueError(f"unknown eviction policy {name!r}; choices: {list(EVICTION_POLICIES)}")
