"""The radix tree's invariants (radix/tree.py's module doc), checked: structure, keys, locks and pins, the
tier-children counts and leaf sets, the pages per tier and per share group, and the namespace roots. Tests and
debugging call it after every operation; it walks the whole tree."""

from __future__ import annotations

from typing import Any

from radix.hashing import page_keys
from radix.node import TIERS


def check_integrity(tree: Any) -> None:
    """Raise AssertionError naming the first violated invariant of `tree` (a radix.tree.RadixTree, which calls
    this: typed loosely so that this module does not import the tree's)."""
    ps = tree.page_size
    pages_in = [0, 0, 0]
    seen: list[set[Any]] = [set(), set(), set()]

    def fail(msg: str) -> None:
        raise AssertionError(f"radix integrity: {msg}")

    for node in tree.nodes():
        parent = node.parent
        if parent is None or parent.children.get(node.tokens[:ps]) is not node:
            fail(f"{node} is not its parent's child under its first page")
        if not node.tokens or len(node.tokens) % ps or len(node.tokens) // ps != len(node.keys):
            fail(f"{node} has {len(node.tokens)} tokens and {len(node.keys)} keys (page size {ps})")
        if node.loc == [None, None, None]:
            fail(f"{node} is resident in no tier")
        if node.lock_ref < 0 or node.pin_ref < 0:
            fail(f"{node} has a negative lock or pin count")
        if parent is not tree.root and node.lock_ref > parent.lock_ref:
            fail(f"{node} lock {node.lock_ref} exceeds its parent's {parent.lock_ref}")
        if parent is not tree.root and node.pin_ref > parent.pin_ref:
            fail(f"{node} pin {node.pin_ref} exceeds its parent's {parent.pin_ref}")
        expect_first = page_keys(tree.last_key(parent), node.tokens[:ps], ps)[0]
        if node.keys[0] != expect_first:
            fail(f"{node} first key does not chain from its parent")
        for ti, pages in enumerate(node.loc):
            in_children = sum(1 for c in node.children.values() if c.loc[ti] is not None)
            if in_children != node.tier_children[ti]:
                fail(f"{node} counts {node.tier_children[ti]} children in {TIERS[ti]}, has {in_children}")
            is_leaf = pages is not None and in_children == 0
            if is_leaf != (node in tree.order.leaves[ti]):
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
    if pages_in != tree.pages_in:
        fail(f"page counts per tier {tree.pages_in} but nodes hold {pages_in}")
    for ti in range(3):
        by_group: dict[int, int] = {}
        for node in tree.nodes():
            if node.loc[ti] is not None:
                by_group[node.group] = by_group.get(node.group, 0) + node.num_pages
        if by_group != tree.group_pages(TIERS[ti]):
            fail(f"{TIERS[ti]} pages per share group {tree.group_pages(TIERS[ti])} but nodes hold {by_group}")
    roots = [n for n in tree.root.children.values() if n.base]
    if len(roots) != len(tree.namespaces):
        fail(f"{len(roots)} namespace roots, {len(tree.namespaces)} counted")
    for ns_root in roots:
        if tree.root.children.get(ns_root.ns) is not ns_root or ns_root.keys or ns_root.loc != [None] * 3:
            fail(f"namespace root {ns_root} is not keyed by its id, or holds pages")
        if any(child.group != ns_root.group for child in ns_root.children.values()):
            fail(f"a child of namespace root {ns_root} is in another share group")
    for ti in range(3):
        for n in tree.order.leaves[ti]:
            if n.parent is None:
                fail(f"removed {n} still in {TIERS[ti]} leaf set")
    for n in tree.nodes():
        if n.own_pins != n.pin_ref - sum(c.pin_ref for c in n.children.values()):
            fail(f"{n} counts {n.own_pins} pins of its own, its path counts say otherwise")
    host_disk = {n.id for n in tree.nodes() if n.loc[1] is not None and n.loc[2] is not None}
    if host_disk != set(tree.host_disk.nodes):
        fail(f"nodes in host memory and L3 {sorted(host_disk)}, indexed {sorted(tree.host_disk.nodes)}")
