"""Commits: the GPU pages requests compute into, from allocation to the tree. `alloc_device` hands out private
pages (evicting cached ones as needed); `commit` inserts a request's full pages under its ticket's prefix and
moves the ticket's lock down to them, `commit_gap` adopts the pages computed in a ticket's gap; where another
request committed the same pages first, the tree's win and the caller's are freed. Write policies fire for
every new page (controller/writes.py)."""

from __future__ import annotations

from collections.abc import Sequence

from controller.eviction import Eviction
from controller.ports import Pool
from controller.ticket import LoadTicket
from controller.writes import Writes
from radix import DEVICE, RadixTree, TreeNode


class Commits:
    """A request's GPU pages: private until committed, then the tree's."""

    def __init__(self, tree: RadixTree, device: Pool, eviction: Eviction, writes: Writes):
        self.tree = tree
        self.device = device
        self.eviction = eviction
        self.writes = writes
        self.private: set[int] = set()  # GPU pages handed to callers, not yet in the tree

    def alloc_device(self, n: int) -> list[int] | None:
        """n private GPU pages for new KV, evicting cached pages as needed; None if impossible."""
        pages = self.eviction.allocate(DEVICE, n)
        if pages is not None:
            self.private.update(pages)
            self.writes.allocated()
        return pages

    def free_device(self, pages: Sequence[int]) -> None:
        """Return private GPU pages (not committed to the tree)."""
        self.private.difference_update(pages)
        self.device.free(pages)

    def commit(self, ticket: LoadTicket, tokens: Sequence[int], device_pages: Sequence[int]) -> list[int]:
        """Insert the full pages of tokens (the ticket's prefix plus new ones; device_pages covers them all, the
        ticket's own first) and move the ticket's lock to the new deepest node. Returns the canonical GPU pages:
        where another request committed the same pages first, the tree's win and the caller's are freed. Write
        policies fire for the new pages."""
        ps = self.tree.page_size
        if ticket.gap is not None:
            raise ValueError(f"commit: the ticket's gap {ticket.gap} is not committed yet (commit_gap)")
        have, full = ticket.num_pages, len(tokens) // ps
        if len(device_pages) < full:
            raise ValueError(f"commit: {full} full pages of tokens but {len(device_pages)} GPU pages")
        if full <= have:
            return ticket.device_pages()[:full]
        node = self._insert(tokens[have * ps : full * ps], device_pages[have:full], ticket.node)
        path: list[TreeNode] = []
        walk: TreeNode | None = node
        while walk is not None and walk is not ticket.node:
            path.append(walk)
            walk = walk.parent
        self.tree.lock(node)
        self.tree.unlock(ticket.node)
        ticket.node = node
        self.writes.committed(path[::-1], continues_hit=ticket.matched_pages > 0)
        return ticket.device_pages()

    def commit_gap(self, ticket: LoadTicket, tokens: Sequence[int], device_pages: Sequence[int]) -> list[int]:
        """Adopt the caller's computed pages [k, k + len(device_pages)) of the ticket's gap [k, s); the gap shrinks
        to what is left (None once committed). Where a gap node got GPU pages meanwhile, the tree's win (the ticket
        may then wait for that load). Returns the canonical GPU pages of the part. Write policies fire."""
        if ticket.gap is None:
            raise ValueError("commit_gap: the ticket has no gap")
        k, s = ticket.gap
        end = k + len(device_pages)  # pages [k, end) are committed now
        if end > s or len(tokens) < end * self.tree.page_size:
            raise ValueError(f"commit_gap: pages [{k}, {end}) for gap [{k}, {s}) and {len(tokens)} tokens")
        if end == k:
            return []
        start = ticket.part(0, k)[-1] if k else ticket.base
        node = self._insert(tokens[k * self.tree.page_size : end * self.tree.page_size], device_pages, start)
        if node not in ticket.nodes:
            raise AssertionError(f"commit_gap: tokens do not follow the ticket's path ({node})")
        ticket.gap = (end, s) if end < s else None
        part = ticket.part(k, end)
        self.writes.committed(part, continues_hit=True)  # a gap lies inside a cached prefix
        return [p for n in part for p in n.device_pages]

    def _insert(self, tokens: Sequence[int], pages: Sequence[int], start: TreeNode) -> TreeNode:
        """Insert private pages under `start`; the caller's duplicates of pages already cached are freed."""
        new_pages = list(pages)
        node, dups = self.tree.insert(tokens, new_pages, DEVICE, start=start)
        self.private.difference_update(new_pages)
        if dups:
            dup_set = set(dups)
            self.private.update(dup_set)
            self.free_device([p for p in new_pages if p in dup_set])
        return node
