"""Eviction order: per tier, the leaves that may leave it, in heaps by priority, one heap per share group.

A share group is a tenant's part of the cache (`RadixTree.namespaces`). Without quotas the order is one
priority order over every group's leaves. With quotas (`set_quotas`, pages per group and tier), a tier that
must make room takes it first from the groups over their quota, lowest priority first among them; only when
none of them has an evictable leaf does it take from any group. A tenant that floods the cache so evicts its
own pages, and another tenant's prefix within its share stays.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

Node = Any  # radix.tree.TreeNode (has .group); kept untyped here to avoid an import cycle


class EvictionOrder:
    """The evictable-leaf sets, priority heaps and pages per share group of the three tiers.

    `priorities[ti]` ranks a node in tier ti (lowest leaves first). Heap entries go stale when a node's
    priority changes or it stops being a leaf; `pop` skips those, and a tier's heaps are rebuilt from its leaf
    set when they hold four times as many entries as there are leaves."""

    def __init__(self, priorities: list[Callable[[Node], Any]]):
        self.priorities = priorities
        self.leaves: list[set[Node]] = [set(), set(), set()]
        self.heaps: list[dict[int, list[tuple[Any, int, Node]]]] = [{}, {}, {}]
        self.group_pages: list[defaultdict[int, int]] = [defaultdict(int), defaultdict(int), defaultdict(int)]
        self.quotas: list[dict[int, int]] = [{}, {}, {}]
        self._entries = [0, 0, 0]
        self._seq = itertools.count()

    def set_quotas(self, ti: int, quotas: dict[int, int]) -> None:
        """Pages each group may keep in tier ti when the tier is contended (groups not named have no quota)."""
        self.quotas[ti] = dict(quotas)

    def over_quota(self, ti: int) -> list[int]:
        """Groups holding more pages of tier ti than their quota."""
        pages = self.group_pages[ti]
        return [g for g, quota in self.quotas[ti].items() if pages.get(g, 0) > quota]

    def push(self, ti: int, node: Node) -> None:
        heap = self.heaps[ti].get(node.group)
        if heap is None:
            heap = self.heaps[ti][node.group] = []
        heapq.heappush(heap, (self.priorities[ti](node), next(self._seq), node))
        self._entries[ti] += 1
        if self._entries[ti] > 4 * len(self.leaves[ti]) + 1024:
            self._rebuild(ti)

    def _rebuild(self, ti: int) -> None:
        priority = self.priorities[ti]
        heaps: dict[int, list[tuple[Any, int, Node]]] = {}
        for node in sorted(self.leaves[ti], key=lambda n: n.id):  # ties in creation order, not by address
            heaps.setdefault(node.group, []).append((priority(node), next(self._seq), node))
        for heap in heaps.values():
            heapq.heapify(heap)
        self.heaps[ti] = heaps
        self._entries[ti] = len(self.leaves[ti])

    def refresh(self, node: Node) -> None:
        """Queue node again where it is a leaf (its priority changed, or it may leave a tier now)."""
        for ti in range(3):
            if node in self.leaves[ti]:
                self.push(ti, node)

    def victims(self, ti: int, group: int | None, incoming: int) -> tuple[list[int] | None, bool]:
        """Whose pages room for `incoming` pages of share group `group` may come from in tier ti: (the groups,
        None for any; strict). The groups over their quota, and `group` itself where the new pages would put it
        over its own: then it is strict, and may take room from no group within its quota."""
        quotas = self.quotas[ti]
        if group is None or not quotas:
            return None, False
        over = self.over_quota(ti)
        strict = self.group_pages[ti].get(group, 0) + incoming > quotas.get(group, float("inf"))
        if strict and group not in over:
            over.append(group)
        return (over or None), strict

    def pop(self, ti: int, held: Callable[[Node, int], bool], skip: Callable[[Node], bool] | None,
            groups: list[int] | None = None, passed: list[Node] | None = None) -> Node | None:
        """The leaf of tier ti to evict next, never one `held` or `skip`ped: from `groups` only where given, else
        from the groups over their quota if one of them has one, else from any group. The node stays a candidate
        (the caller clears its location). Skipped leaves go back into the heap, or, given `passed`, into that list:
        a caller that pops again and again with the same `skip` (one eviction taking many nodes) then does not pop
        them each time, and gives them back with `refresh` when done."""
        if groups is not None:
            return self._pick(ti, groups, held, skip, passed)
        if not self.quotas[ti] and len(self.heaps[ti]) == 1:  # one group, no quotas: its heap alone
            entry = self._top(ti, next(iter(self.heaps[ti])), held, skip, passed)
            return None if entry is None else entry[1]
        over = self.over_quota(ti) if self.quotas[ti] else ()
        if over:
            found = self._pick(ti, over, held, skip, passed)
            if found is not None:
                return found
        return self._pick(ti, list(self.heaps[ti]), held, skip, passed)

    def _pick(self, ti: int, groups: Iterable[int], held: Callable[[Node, int], bool],
              skip: Callable[[Node], bool] | None, passed: list[Node] | None) -> Node | None:
        best, best_prio = None, None
        for group in groups:
            entry = self._top(ti, group, held, skip, passed)
            if entry is not None and (best is None or entry[0] < best_prio):
                best_prio, best = entry
        return best

    def _top(self, ti: int, group: int, held: Callable[[Node, int], bool],
             skip: Callable[[Node], bool] | None, passed: list[Node] | None) -> tuple[Any, Node] | None:
        """The group's lowest-priority leaf that may go (left in its heap), and its priority."""
        heap = self.heaps[ti].get(group)
        if not heap:
            return None
        leaves, priority = self.leaves[ti], self.priorities[ti]
        skipped = [] if passed is None else passed
        found = None
        while heap:
            prio, _, node = heap[0]
            if node in leaves and prio == priority(node) and not held(node, ti):
                if skip is None or not skip(node):
                    found = (prio, node)  # left at the top: it stays a candidate until cleared
                    break
                skipped.append(node)
            # else a stale entry; locked and pinned nodes are pushed again on unlock / unpin
            heapq.heappop(heap)
            self._entries[ti] -= 1
        if passed is None:
            for node in skipped:
                self.push(ti, node)
        return found
