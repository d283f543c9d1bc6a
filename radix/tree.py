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
  host memory (`pop_evictable_interior`), unless the node's own pages are pinned (not just a descendant's).
  A prefix being written, or prefetched for a queued request, would otherwise hold every ancestor's host
  copy, and a few of them filled the host tier so that new pages found no room and were never cached.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from radix.hashing import KEY_BYTES, page_keys
from radix.namespace import namespace_seed
from radix.order import EvictionOrder
from radix.policy import DEFAULT_HALF_LIFE, eviction_priority, tier_policies

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)
_TIER_INDEX = {t: i for i, t in enumerate(TIERS)}
_DEVICE, _HOST, _DISK = _TIER_INDEX[DEVICE], _TIER_INDEX[HOST], _TIER_INDEX[DISK]


class TreeNode:
    """A run of whole pages; per tier, the page ids (or L3 keys) holding them, or None."""

    __slots__ = (
        "parent",
        "children",
        "tokens",
        "keys",
        "loc",
        "tier_children",
        "lock_ref",
        "pin_ref",
        "last_access",
        "hit_count",
        "frequency",
        "id",
        "group",
    )

    _ids = itertools.count()
    base = False  # a namespace root (NamespaceRoot): the top of a key chain, holding no pages

    def __init__(self, parent: TreeNode | None, tokens: tuple[int, ...], keys: list[bytes]):
        self.parent = parent
        self.group = parent.group if parent is not None else 0  # the share group of its namespace
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.tokens = tokens
        self.keys = keys  # chained content hash per page: the page's L3 key
        self.loc: list[list[Any] | None] = [None, None, None]  # per tier index: page ids / keys
        self.tier_children = [0, 0, 0]  # children resident in each tier
        self.lock_ref = 0
        self.pin_ref = 0  # host pins (L3 writes in flight), counted along the path
        self.last_access = 0
        self.hit_count = 0
        self.frequency = 0.0  # references, decayed to last_access (the "lrfu" policy); see RadixTree.touch
        self.id = next(TreeNode._ids)

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    def pages(self, tier: str) -> list[Any] | None:
        """Page ids of this node in `tier` (L3 keys for the disk tier), or None."""
        return self.loc[_TIER_INDEX[tier]]

    @property
    def device_pages(self) -> list[int] | None:
        """GPU page ids, or None when the GPU holds no copy."""
        return self.loc[0]

    @property
    def host_pages(self) -> list[int] | None:
        """Host page ids, or None when host memory holds no copy."""
        return self.loc[1]

    @property
    def disk_keys(self) -> list[bytes] | None:
        """L3 keys, or None when the L3 holds no copy."""
        return self.loc[2]

    @property
    def on_device(self) -> bool:
        return self.loc[0] is not None

    @property
    def on_host(self) -> bool:
        return self.loc[1] is not None

    @property
    def on_disk(self) -> bool:
        return self.loc[2] is not None

    @property
    def removed(self) -> bool:
        """Whether the node has left the tree (its parent link is cut; the root has none either)."""
        return self.parent is None

    def drop_locations(self) -> None:
        """Forget every location of a node the tree has removed (its pages were freed)."""
        if self.parent is not None:
            raise ValueError(f"{self} is still in the tree: clear its locations through the tree")
        self.loc = [None, None, None]

    def in_tier(self, tier: str) -> bool:
        return self.loc[_TIER_INDEX[tier]] is not None

    def tiers(self) -> list[str]:
        return [t for t, pages in zip(TIERS, self.loc) if pages is not None]

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, pages={self.num_pages}, tiers={self.tiers()}, lock={self.lock_ref})"


class NamespaceRoot(TreeNode):
    """The top of one cache namespace: no pages and no tier; its `seed` starts the key chains of the pages below
    it, so equal tokens in two namespaces have different L3 and shared-tier keys. The tree's root is the
    default namespace's (seeded with the tree's namespace fingerprint); the others hang under it, keyed by
    their 16-byte id (`RadixTree.namespace_root`)."""

    __slots__ = ("ns", "seed")
    base = True

    def __init__(self, parent: TreeNode | None, ns: bytes | None, seed: bytes, group: int):
        super().__init__(parent, (), [])
        self.ns = ns
        self.seed = seed
        self.group = group


@dataclass
class MatchResult:
    """Longest cached prefix of a token sequence and how it splits across tiers.

    device_pages / host_pages / disk_pages count the matched pages whose fastest copy is on GPU, on
    host, or only on L3. Usually they come in that order (GPU first, then host, then L3); `segments`
    gives the exact order as (node, fastest tier). `nodes` is the matched path (root excluded); `base` the root
    of the namespace it was matched in (`last_node` where nothing matched).
    """

    nodes: list[TreeNode]
    last_node: TreeNode
    device_pages: int
    host_pages: int
    disk_pages: int
    segments: list[tuple[TreeNode, str]] = field(default_factory=list)  # (node, fastest tier) in order
    base: TreeNode | None = None

    @property
    def num_pages(self) -> int:
        return self.device_pages + self.host_pages + self.disk_pages

    def device_page_ids(self) -> list[int]:
        """GPU page ids of the leading on-GPU part of the prefix."""
        out: list[int] = []
        for node, tier in self.segments:
            if tier != DEVICE:
                break
            out.extend(node.loc[0])
        return out


class RadixTree:
    """Radix tree over token ids at page granularity with per-tier residency and eviction order.

    `page_size` tokens form a page; a trailing partial page is never cached. `namespace` seeds the
    chained page keys of the default namespace; other namespaces (tenants, salts) have roots of their own
    (`namespace_root`), and eviction can give each share group a quota per tier (`set_quotas`).
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
        self.pages_in = [0, 0, 0]  # pages resident per tier
        self.order = EvictionOrder(self.priorities)
        self._leaves = self.order.leaves  # evictable-leaf candidates per tier
        self._namespaces = 0  # namespace roots under the root
        self._namespaces_kept = 0  # of those, how many the last prune kept
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

    def namespace_root(self, ns: bytes | None, group: int = 0) -> NamespaceRoot:
        """The root of namespace `ns` (a 16-byte id; None: the default namespace, the tree's root), made on first
        use with share group `group`. Its key chains start from a seed mixing the tree's namespace fingerprint
        with `ns`. Roots left without pages and locks are removed by `prune_namespaces`."""
        if ns is None:
            return self.root
        node = self.root.children.get(ns)  # type: ignore[call-overload]  # bytes keys never equal token tuples
        if node is None:
            if len(ns) != KEY_BYTES:
                raise ValueError(f"a namespace id is {KEY_BYTES} bytes, got {len(ns)}")
            node = NamespaceRoot(self.root, ns, namespace_seed(self.namespace, ns), group)
            self.root.children[ns] = node  # type: ignore[index]
            self._namespaces += 1
        elif node.group != group:
            raise ValueError(f"namespace {ns.hex()[:8]} is in share group {node.group}, not {group}")
        return node  # type: ignore[return-value]

    def prune_namespaces(self, force: bool = False) -> int:
        """Remove the namespace roots that hold nothing (no child, lock or pin); returns how many. Unless `force`,
        only once their number has doubled since the last prune (a client sending a new salt with each request
        makes a root each time). Call it where no caller holds an unlocked root (the controller's step start)."""
        if not force and self._namespaces <= 2 * self._namespaces_kept + 64:
            return 0
        empty = [key for key, node in self.root.children.items()
                 if node.base and not node.children and node.lock_ref == 0 and node.pin_ref == 0]
        for key in empty:
            self.root.children.pop(key).parent = None
        self._namespaces -= len(empty)
        self._namespaces_kept = self._namespaces
        return len(empty)

    @property
    def namespace_count(self) -> int:
        """Namespace roots under the root (the default namespace not counted)."""
        return self._namespaces

    def match_prefix(self, tokens: Sequence[int], touch: bool = True, base: TreeNode | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens` in the namespace whose root is `base` (default: the
        tree's root).

        Side effects: splits a node when the match ends inside it; with `touch`, marks the matched
        path as accessed now and counts a hit on each of its nodes.
        """
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
                self.touch(n, now, reference=True)
                n.hit_count += 1
                self._refresh(n)
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
        while not node.base:
            parts.append(node.tokens)
            node = node.parent
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
            self._refresh(child)
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
        child.tokens = child.tokens[k * ps :]
        child.keys = child.keys[k:]
        child.loc = [None if p is None else p[k:] for p in child.loc]
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
        self.pages_in[ti] += len(pages)
        self.order.group_pages[ti][node.group] += len(pages)
        parent = node.parent
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
            if ti != _HOST or not self._interior_may_leave(node):
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
        node.loc[ti] = None
        self.pages_in[ti] -= len(pages)
        self.order.group_pages[ti][node.group] -= len(pages)
        self._leaves[ti].discard(node)
        parent = node.parent
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

    def _refresh(self, node: TreeNode) -> None:
        self.order.refresh(node)

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
                      groups: list[int] | None = None) -> TreeNode | None:
        """The lowest-priority unlocked leaf of `tier` (no child resident in `tier`), or None: of share `groups`
        only where given; else, with quotas, from the groups over theirs first (radix.order).

        The node is not modified: the caller moves or drops its pages, then calls clear_location.
        Nodes for which `skip(node)` is true are passed over.
        """
        return self.order.pop(_TIER_INDEX[tier], self._held, skip, groups)

    def pop_evictable_interior(self, skip: Callable[[TreeNode], bool] | None = None) -> TreeNode | None:
        """The lowest-priority host copy that may go although children stay in host memory (see the module doc):
        a node in host memory and in L3 with children in host memory, not locked there and with no pin of its
        own. The node is not modified (the caller then calls clear_location with interior=True). O(host nodes):
        the fallback of an eviction that found no leaf."""
        best, best_prio = None, None
        seen: set[int] = set()
        priority = self.priorities[_HOST]
        for leaf in self._leaves[_HOST]:
            node = leaf.parent
            while node is not self.root and node.loc[_HOST] is not None and node.id not in seen:
                seen.add(node.id)
                if self._interior_may_leave(node) and (skip is None or not skip(node)):
                    prio = priority(node)
                    if best is None or prio < best_prio:
                        best, best_prio = node, prio
                node = node.parent
        return best

    @staticmethod
    def own_pins(node: TreeNode) -> int:
        """Pins of the node's own pages (pin_ref counts its descendants' too)."""
        return node.pin_ref - sum(c.pin_ref for c in node.children.values())

    def _interior_may_leave(self, node: TreeNode) -> bool:
        return (node.loc[_DISK] is not None and node.tier_children[_HOST] > 0
                and not (node.lock_ref > 0 and node.loc[_DEVICE] is None) and self.own_pins(node) == 0)

    def evictable_leaves(self, tier: str) -> list[TreeNode]:
        """All unlocked leaves of `tier`, lowest priority first."""
        ti = _TIER_INDEX[tier]
        return sorted((n for n in self._leaves[ti] if not self._held(n, ti)), key=self.priorities[ti])

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
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`."""
        while node is not None:
            if node.lock_ref <= 0:
                raise ValueError(f"unlock of unlocked {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._refresh(node)
            node = node.parent

    def pin(self, node: TreeNode) -> None:
        """Keep `node` and its ancestors in host memory and in the tree (see the module doc)."""
        while node is not None:
            node.pin_ref += 1
            node = node.parent

    def unpin(self, node: TreeNode) -> None:
        """Undo one `pin(node)`."""
        while node is not None:
            if node.pin_ref <= 0:
                raise ValueError(f"unpin of unpinned {node}")
            node.pin_ref -= 1
            if node.pin_ref == 0 and node.lock_ref == 0:
                self._refresh(node)
            node = node.parent

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
        return [p for n in self.nodes() if n.loc[ti] is not None for p in n.loc[ti]]

    def check_integrity(self) -> None:
        """Verify structure and bookkeeping; raises AssertionError naming the first violation."""
        ps = self.page_size
        pages_in = [0, 0, 0]
        seen: list[set[Any]] = [set(), set(), set()]

        def fail(msg: str) -> None:
            raise AssertionError(f"radix integrity: {msg}")

        for node in self.nodes():
            parent = node.parent
            if parent is None or parent.children.get(node.tokens[:ps]) is not node:
                fail(f"{node} is not its parent's child under its first page")
            if not node.tokens or len(node.tokens) % ps or len(node.tokens) // ps != len(node.keys):
                fail(f"{node} has {len(node.tokens)} tokens and {len(node.keys)} keys (page size {ps})")
            if node.loc == [None, None, None]:
                fail(f"{node} is resident in no tier")
            if node.lock_ref < 0 or node.pin_ref < 0:
                fail(f"{node} has a negative lock or pin count")
            if parent is not self.root and node.lock_ref > parent.lock_ref:
                fail(f"{node} lock {node.lock_ref} exceeds its parent's {parent.lock_ref}")
            if parent is not self.root and node.pin_ref > parent.pin_ref:
                fail(f"{node} pin {node.pin_ref} exceeds its parent's {parent.pin_ref}")
            expect_first = page_keys(self.last_key(parent), node.tokens[:ps], ps)[0]
            if node.keys[0] != expect_first:
                fail(f"{node} first key does not chain from its parent")
            for ti, pages in enumerate(node.loc):
                in_children = sum(1 for c in node.children.values() if c.loc[ti] is not None)
                if in_children != node.tier_children[ti]:
                    fail(f"{node} counts {node.tier_children[ti]} children in {TIERS[ti]}, has {in_children}")
                is_leaf = pages is not None and in_children == 0
                if is_leaf != (node in self._leaves[ti]):
                    fail(f"{node} leaf-set membership wrong for {TIERS[ti]}")
                if pages is None:
                    continue
                if len(pages) != node.num_pages:
                    fail(f"{node} has {len(pages)} {TIERS[ti]} ids for {node.num_pages} pages")
                for p in pages:
                    if p in seen[ti]:
                        fail(f"{TIERS[ti]} page {p!r} owned twice")
                    seen[ti].add(p)
                pages_in[ti] += len(pages)
        if pages_in != self.pages_in:
            fail(f"page counts per tier {self.pages_in} but nodes hold {pages_in}")
        for ti in range(3):
            by_group: dict[int, int] = {}
            for node in self.nodes():
                if node.loc[ti] is not None:
                    by_group[node.group] = by_group.get(node.group, 0) + node.num_pages
            if by_group != self.group_pages(TIERS[ti]):
                fail(f"{TIERS[ti]} pages per share group {self.group_pages(TIERS[ti])} but nodes hold {by_group}")
        roots = [n for n in self.root.children.values() if n.base]
        if len(roots) != self._namespaces:
            fail(f"{len(roots)} namespace roots, {self._namespaces} counted")
        for ns_root in roots:
            if self.root.children.get(ns_root.ns) is not ns_root or ns_root.keys or ns_root.loc != [None] * 3:
                fail(f"namespace root {ns_root} is not keyed by its id, or holds pages")
            if any(child.group != ns_root.group for child in ns_root.children.values()):
                fail(f"a child of namespace root {ns_root} is in another share group")
        for ti in range(3):
            for n in self._leaves[ti]:
                if n.parent is None:
                    fail(f"removed {n} still in {TIERS[ti]} leaf set")
