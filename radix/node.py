"""The nodes of the radix tree: a run of whole pages and where each tier holds them (TreeNode), the top of a
cache namespace (NamespaceRoot), and what a prefix match returns (MatchResult). The tree (radix/tree.py) keeps
them consistent; radix/integrity.py checks that it did."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

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
        "own_pins",
        "last_access",
        "hit_count",
        "frequency",
        "id",
        "group",
        "num_pages",
    )

    _ids = itertools.count()
    base = False  # a namespace root (NamespaceRoot): the top of a key chain, holding no pages

    def __init__(self, parent: TreeNode | None, tokens: tuple[int, ...], keys: list[bytes]):
        self.parent = parent
        self.group: int = parent.group if parent is not None else 0  # the share group of its namespace
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.tokens = tokens
        self.keys = keys  # chained content hash per page: the page's L3 key
        self.num_pages = len(keys)  # kept equal to len(keys) (the tree's split changes both)
        self.loc: list[list[Any] | None] = [None, None, None]  # per tier index: page ids / keys
        self.tier_children = [0, 0, 0]  # children resident in each tier
        self.lock_ref = 0
        self.pin_ref = 0  # host pins (L3 writes in flight), counted along the path
        self.own_pins = 0  # of those, the pins of this node's own pages (RadixTree.pin(self))
        self.last_access = 0
        self.hit_count = 0
        self.frequency = 0.0  # references, decayed to last_access (the "lrfu" policy); see RadixTree.touch
        self.id = next(TreeNode._ids)

    def pages(self, tier: str) -> list[Any] | None:
        """Page ids of this node in `tier` (L3 keys for the disk tier), or None."""
        return self.loc[_TIER_INDEX[tier]]

    # the page ids of a tier the node is known to be in (check on_device / on_host / on_disk first): a ValueError
    # names the node where it is not, rather than a None travelling on

    @property
    def device_pages(self) -> list[int]:
        """GPU page ids."""
        return self._copy_in(0, "the GPU")

    @property
    def host_pages(self) -> list[int]:
        """Host page ids."""
        return self._copy_in(1, "host memory")

    @property
    def disk_keys(self) -> list[bytes]:
        """L3 keys."""
        return self._copy_in(2, "the L3")

    def _copy_in(self, ti: int, where: str) -> list[Any]:
        ids = self.loc[ti]
        if ids is None:
            raise ValueError(f"{self} has no copy in {where}")
        return ids

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

    def tiers(self) -> list[str]:
        return [t for t, pages in zip(TIERS, self.loc) if pages is not None]

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, pages={self.num_pages}, tiers={self.tiers()}, lock={self.lock_ref})"


def in_some_order(node: TreeNode) -> bool:
    """Whether node is a leaf of some tier, so in an eviction order (RadixTree.requeue changes nothing otherwise).
    The test costs less than that call, on paths where most nodes are not (match, unlock)."""
    loc, below = node.loc, node.tier_children
    return ((loc[0] is not None and not below[0]) or (loc[1] is not None and not below[1])
            or (loc[2] is not None and not below[2]))


class NamespaceRoot(TreeNode):
    """The top of one cache namespace: no pages and no tier; its `seed` starts the key chains of the pages below
    it, so equal tokens in two namespaces have different L3 and remote-tier keys. The tree's root is the
    default namespace's (seeded with the tree's namespace fingerprint); the others hang under it, keyed by
    their 16-byte id (`RadixTree.namespaces`)."""

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

