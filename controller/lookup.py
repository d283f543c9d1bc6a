"""Lookup: the longest cached prefix of a token sequence, in the tree and on the L3.

The tree knows what this process cached. The L3 also holds pages written before a restart, and
pages the tree has since forgotten; their keys are the chained page hashes, so past the tree's
match the L3 index is probed for the next pages, in growing batches (a miss ends the chain), and
the leading hits are attached to the tree as disk-only nodes.

A store only this process writes gains a page only through this tree, which then matches it: a page it did not
hold when probed stays missing. Such misses are remembered for MISS_TTL_S, so a queued request's prompt, matched
again and again while it waits (prefetch), asks the store about the page past its cached prefix once in that
time, not on every match (a call to the L3 process each time, ~1 ms). The time bound covers a store that answered
"missing" because it was unreachable for a while. A store shared with other servers (the remote tier) is always
asked: they may have written the page since.

Nor does such a store hold a page the tree has not seen unless it held it at startup: pages written before a
restart. Their keys are read once, when the lookup is built (at most UNTRACKED_KEYS_MAX of them, ~100 bytes each),
and a page outside that set is missing without a call to the store: traffic without reuse asked the L3 process
about every prompt's first page.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from controller.ports import L3
from radix import DISK, MatchResult, RadixTree, TreeNode, page_keys

MISS_TTL_S = 2.0  # how long a page a store only this process writes was found without counts as missing
MISSES_REMEMBERED = 4096  # at most this many such pages (the oldest forgotten first)
UNTRACKED_KEYS_MAX = 1 << 20  # a private store holding more pages at startup is asked about every probe


class Lookup:
    """Prefix matching over the tree, extended by an L3 index probe."""

    def __init__(self, tree: RadixTree, l3: L3, clock: Callable[[], float] = time.monotonic):
        self.tree = tree
        self.l3 = l3
        self.clock = clock
        # page key -> when the store was found without it; only where no other server writes the store
        private = getattr(l3, "shared_pages", None) is None
        self._missed: OrderedDict[bytes, float] | None = OrderedDict() if private else None
        # keys a private store held at startup that the tree has not taken yet; None: ask the store (see the doc)
        self._untracked: set[bytes] | None = self._startup_keys(l3) if private else None

    @staticmethod
    def _startup_keys(l3: L3) -> set[bytes] | None:
        if not l3.capacity_pages:
            return set()
        keys = getattr(l3, "keys", None)
        used = l3.used_pages()
        if keys is None or used > UNTRACKED_KEYS_MAX:
            return None
        found = set(keys()) if used else set()
        return found if len(found) >= used else None  # fewer keys than pages: the answer is not to be trusted

    def match(self, tokens: Sequence[int], base: TreeNode | None = None, reference: bool = True) -> MatchResult:
        """Longest cached prefix of tokens in the namespace rooted at `base` (default: the tree's root); marks it
        accessed (a hit where it is a `reference`: RadixTree.match_prefix) and attaches L3 hits past the tree's
        match."""
        m = self.tree.match_prefix(tokens, base=base, reference=reference)
        full = len(tokens) // self.tree.page_size
        if m.num_pages < full and self.l3.capacity_pages and self._probe(tokens, m.last_node, m.num_pages, full):
            m = self.tree.match_prefix(tokens, touch=False, base=base)
        return m

    def _probe(self, tokens: Sequence[int], node: TreeNode, start: int, end: int) -> int:
        """Probe L3 for pages [start, end) of tokens (chained from node); attach the leading hits."""
        ps = self.tree.page_size
        keys: list[bytes] = []
        found, batch = 0, 1
        missed = self._missed
        while found < end - start:
            prev = keys[-1] if keys else self.tree.last_key(node)
            lo, hi = (start + found) * ps, min(start + found + batch, end) * ps
            chunk = page_keys(prev, tokens[lo:hi], ps)
            if self._untracked is not None and chunk[0] not in self._untracked:
                break  # neither held at startup nor in the tree (see the module doc)
            if missed is not None and self.clock() - missed.get(chunk[0], float("-inf")) < MISS_TTL_S:
                break  # found missing a moment ago (see the module doc)
            keys.extend(chunk)
            hits = self.l3.contains(chunk)
            run = next((i for i, h in enumerate(hits) if not h), len(hits))
            found += run
            if run < len(chunk):
                if missed is not None:
                    missed[chunk[run]] = self.clock()
                    missed.move_to_end(chunk[run])
                    if len(missed) > MISSES_REMEMBERED:
                        missed.popitem(last=False)
                break
            batch *= 4
        if found:
            if self._untracked is not None:
                self._untracked.difference_update(keys[:found])  # the tree tracks them from now on
            suffix = tokens[start * ps : (start + found) * ps]
            self.tree.insert(suffix, keys[:found], tier=DISK, keys=keys[:found], start=node)
        return found
