"""The nodes with a copy both in host memory and in L3, by host eviction priority.

Only such a node's host copy may leave above held pages (radix.tree's module doc: children staying in host memory,
or pinned descendants), so host eviction's fallback (`RadixTree.evictable_interiors`) looks among them alone. They
are kept in a heap by priority, lazily: an entry is pushed when its node enters the index and is stale once the node
has left it. A node's priority only grows (every policy's key: radix.policy), so an entry whose priority is behind
its node's is moved down when it comes up. An item of an iteration then costs a few heap operations, not a scan of
the host nodes: with thousands of pages waiting for a slow disk's writes that scan, at every eviction, was most of
a replay's time (bench/RESULTS.md, 'Offline replay').
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from radix.node import _DEVICE, _DISK, _HOST

Node = Any  # radix.node.TreeNode


def may_leave_above_held(node: Node) -> bool:
    """Whether a node's host copy may go although children stay in host memory or descendants are pinned: L3 holds
    it, it is not locked with only that copy, and none of its own pages is pinned. (A leaf qualifies only with
    pinned descendants; else it is an ordinary leaf.)"""
    return (node.loc[_DISK] is not None and (node.tier_children[_HOST] > 0 or node.pin_ref > 0)
            and not (node.lock_ref > 0 and node.loc[_DEVICE] is None) and node.own_pins == 0)


class HostDiskIndex:
    """See the module doc. `priority`: the host tier's eviction priority (lowest leaves first)."""

    def __init__(self, priority: Callable[[Node], Any]):
        self.priority = priority
        self.nodes: dict[int, Node] = {}
        self._heap: list[tuple[Any, int, int, Node]] = []
        self._seq = itertools.count()

    def __contains__(self, node: Node) -> bool:
        return self.nodes.get(node.id) is node

    def add(self, node: Node) -> None:
        self.nodes[node.id] = node
        heap, priority = self._heap, self.priority
        if len(heap) > 4 * len(self.nodes) + 1024:  # mostly stale entries: rebuild from the index
            heap[:] = [(priority(n), n.id, next(self._seq), n) for n in self.nodes.values()]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, (priority(node), node.id, next(self._seq), node))

    def discard(self, node: Node) -> None:
        self.nodes.pop(node.id, None)

    def by_priority(self, qualifies: Callable[[Node], bool]) -> Iterator[Node]:
        """The indexed nodes for which `qualifies` is true, lowest priority first (ties: the oldest node), each
        asked when its turn comes. A node that does not qualify is set aside and goes back into the heap when the
        iteration ends, so the caller may evict between items; so does one yielded that the caller kept. Two
        iterations at once would each miss what the other set aside: a caller finishes one (or drops it) before
        it starts the next."""
        heap, priority, indexed = self._heap, self.priority, self.__contains__
        aside: list[tuple[Any, int, int, Node]] = []
        met: set[int] = set()  # nodes yielded or passed over (a node indexed twice has two entries)
        try:
            while heap:
                entry = heap[0]
                prio, _, _, node = entry
                if not indexed(node):
                    heapq.heappop(heap)  # stale: it left host memory or L3
                    continue
                if node.id in met:  # another entry of a node met already (yielded and kept by the caller)
                    aside.append(heapq.heappop(heap))
                    continue
                now = priority(node)
                if now != prio:  # used since it was pushed: its place is further down
                    heapq.heapreplace(heap, (now, node.id, next(self._seq), node))
                    continue
                met.add(node.id)
                if qualifies(node):
                    yield node
                    if heap and heap[0] is entry:
                        heapq.heappop(heap)
                        if indexed(node) and prio == priority(node):
                            aside.append(entry)  # the caller kept it: not again in this iteration
                    continue  # else the caller evicted it (its tail: the upper part is a new node, pushed)
                aside.append(heapq.heappop(heap))  # passed over
        finally:
            for entry in aside:
                heapq.heappush(heap, entry)
