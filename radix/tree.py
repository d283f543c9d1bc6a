"""The radix tree: token ids at page granularity, and where each cached page lives.

A node holds a run of whole pages. For each tier it records the page ids of those pages in that
tier (GPU page ids, host page ids, or the L3 keys) or None when the tier has no copy. All pages of
one node share the same residency; nodes are split at page boundaries when that stops being true.

Invariants (checked by `check_integrity`):
- every node but the root is resident in at least one tier; a node that leaves its last tier is
  removed, and it is then a leaf;
- eviction in a tier takes leaves of that tier first (a parent outlives its children), so
  residency is usually prefix-closed per tier; where it is not (a continuation found on L3 under
  a prefix that is only in memory), a node that leaves its last tier takes its whole subtree with
  it, since nothing below an uncached page can be reached;
- a locked node (lock_ref > 0, counted along the path to the root) is never evicted from the GPU or L3;
  its host copy may go once the node is on the GPU (a lock guards the pages a request reads, and those are
  the GPU's; the host copy of a running request's prefix is a spare, and holding it starved the host tier of
  room for new pages). Whoever evicts keeps a host copy that a transfer still reads (`pop_evictable`'s skip);
- a pinned node (pin_ref > 0, also counted along the path) keeps its host copy and is never removed,
  but may leave the GPU or L3 while another tier holds it: pins guard host pages that an L3 write is
  reading, without holding GPU pages hostage to the disk's speed;
- one exception to leaves first: the host copy of a node that L3 also holds may go while children stay in
  host memory, or while descendants are pinned (`pop_evictable_interior`), unless the node's own pages are
  pinned. A prefix being written, or prefetched for a queued request (its pinned pages still reading from
  disk, below ancestors in host memory), would otherwise hold every ancestor's host copy, and a few of them
  filled the host tier so that new pages found no room and were never cached.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from radix.hashing import KEY_BYTES, page_keys
from radix.host_disk import HostDiskIndex, may_leave_above_held
from radix.integrity import check_integrity
from radix.namespace import NamespaceRoots
from radix.node import (
    _DEVICE,
    _DISK,
    _HOST,
    _TIER_INDEX,
    DEVICE,
    DISK,
    HOST,
    TIERS,
    MatchResult,
    NamespaceRoot,
    TreeNode,
    in_some_order,
)
from radix.order import EvictionOrder
from radix.policy import DEFAULT_HALF_LIFE, eviction_priority, tier_policies

__all__ = ["DEVICE", "DISK", "HOST", "TIERS", "MatchResult", "NamespaceRoot", "RadixTree", "TreeNode"]


class RadixTree:
    """Radix tree over token ids at page granularity with per-tier residency and eviction order.

    `page_size` tokens form a page; a trailing partial page is never cached. `namespace` seeds the
    chained page keys of the default namespace; other namespaces (tenants, salts) have roots of their own
    (`namespaces`, radix.namespace), and eviction can give each share group a quota per tier (`set_quotas`).
    `eviction_policy` names a policy of `radix.policy` (a priority function per tier, `tier_policies`);
    `half_life` is the decay of its "lrfu" frequency, in ticks of the tree's clock.
    """

    def __init__(self, page_size: int, namespace: bytes = bytes(KEY_BYTES), eviction_policy: str = "lru",
                 half_life: float = DEFAULT_HALF_LIFE):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if len(namespace) != KEY_BYTES:
            raise ValueError(f"namespace must be {KEY_BYTES} bytes, got {len(namespace)}")
        self.page_size = page_size
        self.namespace = namespace
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.half_life = float(half_life)
        # per tier (device, host, disk); see radix.policy.tier_policies
        self.priorities: list[Callable[[TreeNode], Any]] = [
            eviction_priority(name, self.half_life) for name in tier_policies(eviction_policy)]
        self.root: NamespaceRoot = NamespaceRoot(None, None, namespace, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        # nodes with a copy both in host memory and in L3: where `evictable_interiors` looks
        self.host_disk = HostDiskIndex(self.priorities[_HOST])
        self.pages_in = [0, 0, 0]  # pages resident per tier
        self.order = EvictionOrder(self.priorities)
        self._leaves = self.order.leaves  # evictable-leaf candidates per tier
        self.namespaces = NamespaceRoots(self.root, namespace)  # the other namespaces' roots, under the root
        # called as listener(upper, lower) whenever a node is split: state kept beside the tree per node (the
        # controller's transfers table) follows the pages into both parts
        self.split_listeners: list[Callable[[TreeNode, TreeNode], None]] = []

    # ------------------------------------------------------------------ lookup

    def tick(self) -> int:
        """Advance and return the logical clock used for last-access times."""
        self._clock += 1
        return self._clock

    def touch(self, node: TreeNode, now: int, reference: bool) -> None:
        """Mark `node` accessed at `now`. A reference (a prefix hit, or the node's creation) also counts towards
        its decayed frequency: the count halves every `half_life` ticks, so "lrfu" ranks a page by recency
        and by how often it was used lately. A commit passing over an existing node refreshes its recency only
        (under "lrfu" that leaves its rank as it was)."""
        decay = 2.0 ** ((node.last_access - now) / self.half_life)
        node.frequency = node.frequency * decay + (1.0 if reference else 0.0)
        node.last_access = now

    def match_prefix(self, tokens: Sequence[int], touch: bool = True, base: TreeNode | None = None,
                     reference: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens` in the namespace whose root is `base` (default: the tree's
        root). Side effects: splits a node when the match ends inside it; with `touch`, marks the matched path as
        accessed now and, where it is a `reference` (a use, not a queued request looking again), counts a hit on
        each of its nodes."""
        ps = self.page_size
        tokens = tuple(tokens)
        end = len(tokens) // ps * ps
        start = base if base is not None else self.root
        node, pos = start, 0
        path: list[TreeNode] = []
        while pos < end:
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            clen = len(child.tokens)
            if tokens[pos : pos + clen] != child.tokens:
                matched = ps
                while matched < clen and pos + matched < end and (
                    tokens[pos + matched : pos + matched + ps] == child.tokens[matched : matched + ps]
                ):
                    matched += ps
                if matched < clen:
                    child = self._split(child, matched // ps)
                    clen = matched
            path.append(child)
            pos += clen
            node = child
        if touch and path:
            now = self.tick()
            for n in path:
                self.touch(n, now, reference)
                n.hit_count += reference
                if in_some_order(n):
                    self.requeue(n)
        return self._result(path, start)

    def _result(self, path: list[TreeNode], base: TreeNode) -> MatchResult:
        counts = [0, 0, 0]
        segments = []
        for n in path:
            t = 0 if n.loc[0] is not None else 1 if n.loc[1] is not None else 2
            counts[t] += n.num_pages
            segments.append((n, TIERS[t]))
        last = path[-1] if path else base
        return MatchResult(path, last, counts[0], counts[1], counts[2], segments, base)

    def path_tokens(self, node: TreeNode) -> tuple[int, ...]:
        """All tokens from its namespace's root down to and including `node`."""
        parts = []
        walk: TreeNode | None = node
        while walk is not None and not walk.base:
            parts.append(walk.tokens)
            walk = walk.parent
        return tuple(itertools.chain.from_iterable(reversed(parts)))

    def last_key(self, node: TreeNode) -> bytes:
        """The chain key of the last page of `node` (a namespace root's seed for a namespace root)."""
        return node.keys[-1] if node.keys else node.seed  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ insertion

    def insert(
        self,
        tokens: Sequence[int],
        pages: Sequence[Any],
        tier: str = DEVICE,
        keys: Sequence[bytes] | None = None,
        start: TreeNode | None = None,
    ) -> tuple[TreeNode, list[Any]]:
        """Record that the full pages of `tokens` are resident in `tier` at `pages` (one id per page).

        Pages already resident in `tier` keep their existing ids; the caller's duplicates are
        returned so it can free them. Existing nodes not yet in `tier` adopt the given ids.
        With `start`, `tokens` continue the path of that node instead of starting at the root.
        Returns (deepest node, duplicate page ids). Marks the path as accessed now.
        """
        ps = self.page_size
        ti = _TIER_INDEX[tier]
        tokens = tuple(tokens)
        n_pages = len(tokens) // ps
        if len(pages) != n_pages:
            raise ValueError(f"insert: {n_pages} full pages of tokens but {len(pages)} page ids")
        if keys is not None and len(keys) != n_pages:
            raise ValueError(f"insert: {n_pages} full pages of tokens but {len(keys)} keys")
        now = self.tick()
        duplicates: list[Any] = []
        node, page = (start if start is not None else self.root), 0
        while page < n_pages:
            pos = page * ps
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                rest = tokens[pos : n_pages * ps]
                new_keys = list(keys[page:]) if keys is not None else page_keys(self.last_key(node), rest, ps)
                child = TreeNode(node, rest, new_keys)
                node.children[rest[:ps]] = child
                self.touch(child, now, reference=True)
                self._set_loc(child, ti, list(pages[page:]))
                node = child
                break
            k = 1
            cpages = child.num_pages
            while k < cpages and page + k < n_pages and (
                tokens[pos + k * ps : pos + (k + 1) * ps] == child.tokens[k * ps : (k + 1) * ps]
            ):
                k += 1
            if k < cpages:
                child = self._split(child, k)
            if child.loc[ti] is None:
                self._set_loc(child, ti, list(pages[page : page + k]))
            else:
                duplicates.extend(pages[page : page + k])
            self.touch(child, now, reference=False)
            self.requeue(child)
            node = child
            page += k
        return node, duplicates

    def split(self, node: TreeNode, k: int) -> TreeNode:
        """Split `node` after its first k pages (0 < k < pages); returns the upper part."""
        if not 0 < k < node.num_pages:
            raise ValueError(f"cannot split {node} after {k} pages")
        return self._split(node, k)

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Split `child` after its first k pages; returns the new upper node (which keeps the tiers)."""
        ps = self.page_size
        parent = child.parent
        mid = TreeNode(parent, child.tokens[: k * ps], child.keys[:k])
        mid.loc = [None if p is None else p[:k] for p in child.loc]
        mid.tier_children = [1 if p is not None else 0 for p in child.loc]
        mid.lock_ref = child.lock_ref
        mid.pin_ref = child.pin_ref
        mid.last_access = child.last_access
        mid.hit_count = child.hit_count
        mid.frequency = child.frequency
        if child in self.host_disk:
            self.host_disk.add(mid)
        child.tokens = child.tokens[k * ps :]
        child.keys = child.keys[k:]
        child.num_pages = len(child.keys)
        child.loc = [None if p is None else p[k:] for p in child.loc]
        assert parent is not None
        parent.children[mid.tokens[:ps]] = mid
        mid.children[child.tokens[:ps]] = child
        child.parent = mid
        for listener in self.split_listeners:
            listener(mid, child)
        return mid

    # ------------------------------------------------------------------ residency

    def set_location(self, node: TreeNode, tier: str, pages: Sequence[Any]) -> None:
        """Record that `node`'s pages now also live in `tier` at `pages`."""
        ti = _TIER_INDEX[tier]
        if node.loc[ti] is not None:
            raise ValueError(f"{node} is already resident in {tier}")
        if len(pages) != node.num_pages:
            raise ValueError(f"{node}: {len(pages)} page ids for {node.num_pages} pages")
        self._set_loc(node, ti, list(pages))

    def _set_loc(self, node: TreeNode, ti: int, pages: list[Any]) -> None:
        node.loc[ti] = pages
        if ti != _DEVICE and node.loc[_HOST] is not None and node.loc[_DISK] is not None:
            self.host_disk.add(node)
        self.pages_in[ti] += len(pages)
        self.order.group_pages[ti][node.group] += len(pages)
        parent = node.parent
        assert parent is not None
        if not parent.base:
            parent.tier_children[ti] += 1
            self._leaves[ti].discard(parent)
        if node.tier_children[ti] == 0:
            self._leaves[ti].add(node)
            self._push(ti, node)
        if ti == _DEVICE and node.lock_ref > 0 and node in self._leaves[_HOST]:
            self._push(_HOST, node)  # locked, its host copy may go now (it was passed over as held before)

    def clear_location(self, node: TreeNode, tier: str, interior: bool = False) -> tuple[list[Any], list[TreeNode]]:
        """Drop `node`'s copy in `tier`; returns (its page ids there, orphaned descendants).

        The node must have no child resident in `tier` (leaves first), unless `interior`: a host copy
        `pop_evictable_interior` may take. When the node is then in no tier it is removed with its
        subtree; the removed descendants are returned with their `loc` intact so the caller can free
        their pages in every tier.
        """
        ti = _TIER_INDEX[tier]
        pages = node.loc[ti]
        if pages is None:
            raise ValueError(f"{node} is not resident in {tier}")
        if interior:
            if ti != _HOST or not may_leave_above_held(node):
                raise ValueError(f"{node}'s {tier} copy may not leave before its children's")
        elif node.tier_children[ti]:
            raise ValueError(f"{node} has children in {tier}; evict them first")
        elif self._held(node, ti):
            raise ValueError(f"{node} is locked" if node.lock_ref else f"{node} is pinned in host memory")
        self._unset_loc(node, ti)
        orphans: list[TreeNode] = []
        if node.loc == [None, None, None]:
            orphans = self._detach(node)
        return pages, orphans

    def _unset_loc(self, node: TreeNode, ti: int) -> None:
        pages = node.loc[ti]
        assert pages is not None
        node.loc[ti] = None
        if ti != _DEVICE:
            self.host_disk.discard(node)
        self.pages_in[ti] -= len(pages)
        self.order.group_pages[ti][node.group] -= len(pages)
        self._leaves[ti].discard(node)
        parent = node.parent
        assert parent is not None
        if not parent.base:
            parent.tier_children[ti] -= 1
            if parent.tier_children[ti] == 0 and parent.loc[ti] is not None:
                self._leaves[ti].add(parent)
                self._push(ti, parent)

    def unassign(self, node: TreeNode, tier: str) -> list[Any]:
        """Take back the page ids of `tier` that a load was to fill, when the load will not fill them (a request
        gave up waiting for its disk read); returns them for the caller to free. No data leaves, so unlike
        `clear_location` it ignores locks and children; the node must keep another copy."""
        ti = _TIER_INDEX[tier]
        pages = node.loc[ti]
        if pages is None:
            raise ValueError(f"{node} is not resident in {tier}")
        if all(loc is None for i, loc in enumerate(node.loc) if i != ti):
            raise ValueError(f"{node}: unassigning {tier} would leave it in no tier")
        self._unset_loc(node, ti)
        return pages

    def remove_subtree(self, node: TreeNode) -> list[TreeNode]:
        """Remove an unlocked node and everything below it, whatever their tiers.

        Returns the removed nodes (node first) with `loc` intact so the caller can free their pages.
        """
        if node.lock_ref > 0 or node.pin_ref > 0:
            raise ValueError(f"{node} is locked or pinned")
        for ti in range(3):
            if node.loc[ti] is not None:
                pages = node.loc[ti]
                self._unset_loc(node, ti)
                node.loc[ti] = pages  # _unset_loc cleared it; the caller still needs the ids
        return [node, *self._detach(node)]

    def _detach(self, node: TreeNode) -> list[TreeNode]:
        """Remove `node` (in no tier) and its subtree; returns the removed descendants."""
        assert node.parent is not None
        del node.parent.children[node.tokens[: self.page_size]]
        node.parent = None
        removed: list[TreeNode] = []
        stack = list(node.children.values())
        node.children = {}
        while stack:
            n = stack.pop()
            if n.lock_ref > 0 or n.pin_ref > 0:
                raise AssertionError(f"locked {n} below unlocked {node}")  # locks count along the path
            removed.append(n)
            self.host_disk.discard(n)
            for ti, pages in enumerate(n.loc):
                if pages is not None:
                    self.pages_in[ti] -= len(pages)
                    self.order.group_pages[ti][n.group] -= len(pages)
                    self._leaves[ti].discard(n)
            stack.extend(n.children.values())
            n.parent = None
        return removed

    def _push(self, ti: int, node: TreeNode) -> None:
        self.order.push(ti, node)

    def set_quotas(self, tier: str, quotas: dict[int, int]) -> None:
        """Pages each share group may keep in `tier` when it is contended: eviction there takes the pages of the
        groups over their quota first (radix.order)."""
        self.order.set_quotas(_TIER_INDEX[tier], quotas)

    def group_pages(self, tier: str) -> dict[int, int]:
        """Pages of `tier` held per share group."""
        return {g: n for g, n in self.order.group_pages[_TIER_INDEX[tier]].items() if n}

    def quota_victims(self, tier: str, group: int | None, incoming: int) -> tuple[list[int] | None, bool]:
        """Whose pages of `tier` may make room for `incoming` pages of share group `group`: (groups, None for any;
        strict: `group` would go over its quota, so no group within its quota gives room). radix.order."""
        return self.order.victims(_TIER_INDEX[tier], group, incoming)

    def pop_evictable(self, tier: str, skip: Callable[[TreeNode], bool] | None = None,
                      groups: list[int] | None = None, passed: list[TreeNode] | None = None) -> TreeNode | None:
        """The lowest-priority unlocked leaf of `tier` (no child resident in `tier`), or None: of share `groups`
        only where given; else, with quotas, from the groups over theirs first (radix.order).

        The node is not modified: the caller moves or drops its pages, then calls clear_location.
        Nodes for which `skip(node)` is true are passed over; given `passed`, they are set aside there until the
        caller `requeue`s them (radix.order.EvictionOrder.pop).
        """
        return self.order.pop(_TIER_INDEX[tier], self._held, skip, groups, passed)

    def requeue(self, node: TreeNode) -> None:
        """Put node (again) into the eviction order of the tiers where it is a leaf: its priority changed, it may
        leave now, or a caller that left it out (`pop_evictable`'s `passed`) for a state of its own that ended."""
        self.order.refresh(node)

    def pop_evictable_interior(self, skip: Callable[[TreeNode], bool] | None = None) -> TreeNode | None:
        """The first of `evictable_interiors`, or None."""
        return next(self.evictable_interiors(skip), None)

    def evictable_interiors(self, skip: Callable[[TreeNode], bool] | None = None) -> Iterator[TreeNode]:
        """Host copies that may go although children stay in host memory or descendants are pinned (the module doc;
        `may_leave_above_held`) and `skip` is false, lowest priority first: the fallback of an eviction that found no
        leaf. The caller may evict between items; `skip` runs only for the node whose turn it is (radix.host_disk)."""
        return self.host_disk.by_priority(lambda node: may_leave_above_held(node) and (skip is None or not skip(node)))

    @staticmethod
    def own_pins(node: TreeNode) -> int:
        """Pins of the node's own pages (pin_ref counts its descendants' too)."""
        return node.own_pins

    @staticmethod
    def _held(node: TreeNode, ti: int) -> bool:
        """Whether node may not leave tier ti now: it is locked (in host memory: and not on the GPU), or pinned
        and the tier is host or its last."""
        if node.lock_ref > 0 and (ti != _HOST or node.loc[_DEVICE] is None):
            return True
        if node.pin_ref == 0:
            return False
        return ti == _TIER_INDEX[HOST] or all(pages is None for i, pages in enumerate(node.loc) if i != ti)

    # ------------------------------------------------------------------ locking

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (from host memory only while not on the GPU)."""
        walk: TreeNode | None = node
        while walk is not None:
            walk.lock_ref += 1
            walk = walk.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`."""
        walk: TreeNode | None = node
        while walk is not None:
            if walk.lock_ref <= 0:
                raise ValueError(f"unlock of unlocked {walk}")
            walk.lock_ref -= 1
            if walk.lock_ref == 0 and in_some_order(walk):
                self.requeue(walk)
            walk = walk.parent

    def pin(self, node: TreeNode) -> None:
        """Keep `node` and its ancestors in host memory and in the tree (see the module doc)."""
        node.own_pins += 1
        walk: TreeNode | None = node
        while walk is not None:
            walk.pin_ref += 1
            walk = walk.parent

    def unpin(self, node: TreeNode) -> None:
        """Undo one `pin(node)`."""
        if node.own_pins <= 0:
            raise ValueError(f"unpin of unpinned {node}")
        node.own_pins -= 1
        walk: TreeNode | None = node
        while walk is not None:
            if walk.pin_ref <= 0:
                raise ValueError(f"unpin of unpinned {walk}")
            walk.pin_ref -= 1
            if walk.pin_ref == 0 and walk.lock_ref == 0:
                self.requeue(walk)
            walk = walk.parent

    # ------------------------------------------------------------------ inspection

    def nodes(self) -> Iterator[TreeNode]:
        """All nodes that hold pages (not the namespace roots), parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if not node.base:
                yield node
            stack.extend(node.children.values())

    def owned_pages(self, tier: str) -> list[Any]:
        """Every page id (or key) the tree records in `tier`."""
        ti = _TIER_INDEX[tier]
        return [p for n in self.nodes() for p in (n.loc[ti] or ())]

    def check_integrity(self) -> None:
        """Verify structure and bookkeeping; raises AssertionError naming the first violation (radix/integrity.py)."""
        check_integrity(self)
