"""Eviction policies as priority functions of a node: the lowest priority is evicted first."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radix.tree import TreeNode


def _lru(node: TreeNode) -> Any:
    return node.last_access


def _lfu(node: TreeNode) -> Any:
    return (node.hit_count, node.last_access)


EVICTION_POLICIES: dict[str, Callable[[TreeNode], Any]] = {"lru": _lru, "lfu": _lfu}


def eviction_priority(name: str) -> Callable[[TreeNode], Any]:
    """The priority function registered under `name`; raises ValueError listing the choices."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choices: {sorted(EVICTION_POLICIES)}") from None
