"""Lookup: the longest cached prefix of a token sequence, in the tree and on the L3.

The tree knows what this process cached. The L3 also holds pages written before a restart, and
pages the tree has since forgotten; their keys are the chained page hashes, so past the tree's
match the L3 index is probed for the next pages, in growing batches (a miss ends the chain), and
the leading hits are attached to the tree as disk-only nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

from controller.ports import L3
from radix import DISK, MatchResult, RadixTree, TreeNode, page_keys


class Lookup:
    """Prefix matching over the tree, extended by an L3 index probe."""

    def __init__(self, tree: RadixTree, l3: L3):
        self.tree = tree
        self.l3 = l3

    def match(self, tokens: Sequence[int], base: TreeNode | None = None) -> MatchResult:
        """Longest cached prefix of tokens in the namespace rooted at `base` (default: the tree's root); marks it
        accessed and attaches L3 hits past the tree's match."""
        m = self.tree.match_prefix(tokens, base=base)
        full = len(tokens) // self.tree.page_size
        if m.num_pages < full and self.l3.capacity_pages and self._probe(tokens, m.last_node, m.num_pages, full):
            m = self.tree.match_prefix(tokens, touch=False, base=base)
        return m

    def _probe(self, tokens: Sequence[int], node: TreeNode, start: int, end: int) -> int:
        """Probe L3 for pages [start, end) of tokens (chained from node); attach the leading hits."""
        ps = self.tree.page_size
        keys: list[bytes] = []
        found, batch = 0, 1
        while found < end - start:
            prev = keys[-1] if keys else self.tree.last_key(node)
            lo, hi = (start + found) * ps, min(start + found + batch, end) * ps
            chunk = page_keys(prev, tokens[lo:hi], ps)
            keys.extend(chunk)
            hits = self.l3.contains(chunk)
            run = next((i for i, h in enumerate(hits) if not h), len(hits))
            found += run
            if run < len(chunk):
                break
            batch *= 4
        if found:
            suffix = tokens[start * ps : (start + found) * ps]
            self.tree.insert(suffix, keys[:found], tier=DISK, keys=keys[:found], start=node)
        return found
