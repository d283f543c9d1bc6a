"""Eviction: room in a tier is made by dropping its lowest-priority unlocked leaves, page-exact.

Before pages leave a tier the `EvictionHook` (the write policies) may save them a tier down
(write-back). Freed GPU pages wait, on the GPU, for a backup copy still reading them, so the GPU takes a leaf
that needs no such wait before a few lower-priority ones that do (`_DevicePicks`). Nodes that leave their last
tier are removed from the tree with their subtree, and every page they held is freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from controller.ports import L3, Pool
from controller.stats import CacheStats
from controller.transfers import InFlight, Transfers
from radix import DEVICE, DISK, HOST, RadixTree, TreeNode

_clock = time.perf_counter  # times the engine thread's waits (a test replaces it)

# How many GPU leaves one eviction passes over because freeing them would wait for a copy, before it takes them in
# order anyway (`_DevicePicks`): enough to find a leaf already copied among a few recent deferred ones, few enough that
# a pool full of uncopied pages costs each eviction little.
COPY_LOOKAHEAD = 16


class EvictionHook(Protocol):
    """Told about a node just before its pages leave a tier (it may copy them down first)."""

    def evicting(self, tier: str, node: TreeNode) -> None: ...

    def copies_before_leaving(self, tier: str, node: TreeNode) -> bool:
        """Whether `evicting` would copy the node's pages down now, before they may be freed."""

    def removed(self, node: TreeNode) -> None:
        """The tree removed the node with an ancestor (an orphan: its pages are freed without an eviction)."""


class _NoHook:
    def evicting(self, tier: str, node: TreeNode) -> None:
        return None

    def copies_before_leaving(self, tier: str, node: TreeNode) -> bool:
        return False

    def removed(self, node: TreeNode) -> None:
        return None


class Eviction:
    """Allocation with eviction per tier, and the freeing of removed nodes (see the module doc)."""

    def __init__(self, tree: RadixTree, device: Pool, host: Pool, l3: L3, transfers: Transfers, stats: CacheStats,
                 disk_capacity: int):
        self.tree = tree
        self.device = device
        self.host = host
        self.l3 = l3
        self.transfers = transfers
        self.stats = stats
        self.disk_capacity = disk_capacity
        self.disk_inflight = 0  # pages queued for L3 writes, counted against the disk capacity
        self.hook: EvictionHook = _NoHook()
        # whether a host node's L3 write is pending (waiting for the queue): it leaves host memory last (Writes)
        self.write_pending: Callable[[TreeNode], bool] = lambda node: False
        # every such node; one left out of the host eviction order goes back in when its write stops waiting
        # (`RadixTree.requeue`, the write mechanism's business)
        self.pending_nodes: Callable[[], Iterable[TreeNode]] = lambda: ()
        self.landing: list[tuple[Any, list[int]]] = []  # (copy, host pages) freed while that copy still lands

    def allocate(self, tier: str, n: int, protect: TreeNode | None = None, group: int | None = None,
                 wait: bool = True) -> list[int] | None:
        """n free pages of the GPU or host tier, evicting there as needed (never `protect`); None if impossible.
        `group`: the share group the pages will cache (a backup, a prefetch): with shares, pages that would put it
        over its own may evict only the pages of groups over theirs, its own first (`evict`). Host pages freed
        while a GPU -> host copy still lands in them are room only once it has landed: `wait` (the engine thread
        blocks for the oldest of those copies, as many as it needs), else they are not room now."""
        pool = self.device if tier == DEVICE else self.host
        if n > pool.capacity_pages:
            return None
        if tier == HOST and self.landing and pool.allocator.free_pages < n:
            self.reap_host_frees()
        if pool.allocator.free_pages < n:
            self.evict(tier, n - pool.allocator.free_pages, protect, group, n)
        if wait and tier == HOST and self.landing and pool.allocator.free_pages < n:
            self.reap_host_frees(need=n)  # no other room: the pages of the copies landing are the room
        return pool.allocate(n)

    def evict(self, tier: str, need: int, protect: TreeNode | None = None, group: int | None = None,
              incoming: int = 0) -> int:
        """Evict the lowest-priority unlocked leaves of a tier until `need` pages are free there. The host copy of
        a locked node on the GPU may go (see radix.tree), unless a copy to the GPU still reads it.

        With shares (TierController.set_shares) the leaves of the groups over their share go first. Room for
        `incoming` pages of share group `group` that would put it over its own share comes only from those
        groups and its own pages: a tenant flooding the cache evicts itself, never another's pages within their
        share (the room is then not made, and the caller drops what it would have cached)."""
        freed = 0
        groups, strict = self.tree.quota_victims(tier, group, incoming)
        skip: Callable[[TreeNode], bool] | None
        if tier == HOST:
            skip = lambda node: (node is protect or (node.lock_ref > 0 and not self.transfers.ready(node))  # noqa: E731
                                 or self._landing(node))
        else:
            skip = (lambda node: node is protect) if protect is not None else None
        picks: _HostPicks | _DevicePicks | None = None
        if tier == HOST:
            picks = _HostPicks(self.tree, self.write_pending, self.pending_nodes)
        elif tier == DEVICE:
            picks = _DevicePicks(self.tree, self._waits_for_copy)
        try:
            while freed < need:
                node, interior = (picks.next(skip, groups) if picks is not None
                                  else (self.tree.pop_evictable(tier, skip, groups), False))
                if node is None and groups is not None and not strict:
                    groups = None  # the groups over their share have nothing left to give: any group's, by priority
                    continue
                if node is None:
                    break
                freed += self.evict_node(tier, self._tail(node, need - freed), interior)
        finally:
            if picks is not None:
                picks.done()
        return freed

    def _waits_for_copy(self, node: TreeNode) -> bool:
        """Whether freeing the node's GPU pages now waits for a GPU -> host copy: its backup still reads them, or the
        write policy makes one before they leave (a deferred backup). That wait is for every copy queued before it:
        taking such a leaf while others could go free cost the engine the copy queue's length per eviction
        (bench/RESULTS.md, 'Offline replay')."""
        pages = node.device_pages
        handle = self.transfers.backups.get(pages[-1]) if pages else None
        return (handle is not None and not handle.done()) or self.hook.copies_before_leaving(DEVICE, node)

    def _landing(self, node: TreeNode) -> bool:
        """Whether a GPU -> host copy still lands in the node's host pages (a backup just made). Such pages are no
        room until it lands, after the forward that computes them: evicting them made the engine thread wait for the
        GPU (hundreds of milliseconds a step under write pressure), only to drop one new page for another."""
        pages = node.host_pages
        handle = self.transfers.host_fills.get(pages[-1]) if pages else None
        return handle is not None and not handle.done()

    def _tail(self, node: TreeNode, pages: int) -> TreeNode:
        """The last `pages` pages of node as their own node (split off), or node if it is no larger.

        Within a node the last pages are the least valuable (a parent outlives its children), so only
        as many as needed leave the tier.
        """
        if node.num_pages > pages:
            self.tree.split(node, node.num_pages - pages)  # `node` keeps the tail
        return node

    def evict_node(self, tier: str, node: TreeNode, interior: bool = False) -> int:
        """Drop node's copy in `tier` (the hook may save it first); returns the pages freed. A write-back of a node
        larger than the L3 queue takes splits it into parts: only the last stays `node` and leaves the tier here,
        the parts above it stay (written) for the caller's next pick. `interior`: a host copy with children
        staying in host memory (RadixTree.pop_evictable_interior)."""
        self.hook.evicting(tier, node)
        n = node.num_pages
        self.stats.evictions[tier] += n
        if tier == DEVICE and self.transfers.disk_load(node) is None:
            self.transfers.clear(node)  # a finished promotion into the pages being freed
        pages, orphans = self.tree.clear_location(node, tier, interior)
        if tier == DISK:
            self.l3.delete(pages, wait=False)
        elif tier == DEVICE:
            self.free_device_pages(pages)
        else:
            self.free_host_pages(pages)
        if node.removed:
            self.transfers.forget(node)
        self.free_nodes(orphans)
        return n

    def free_host_pages(self, pages: Sequence[int]) -> None:
        """Free tree-owned host pages; a page a GPU -> host copy is still landing in is freed once it has landed
        (`reap_host_frees`), or the copy would overwrite its next owner's bytes (a disk read, another copy). The
        engine thread does not wait for it unless the host tier has no other room (`allocate`)."""
        fills = self.transfers.host_fills
        ready: list[int] = []
        later: dict[int, tuple[Any, list[int]]] = {}
        busy = InFlight()
        for p in pages:
            handle = fills.pop(p, None)
            if handle is not None and busy(handle):
                later.setdefault(id(handle), (handle, []))[1].append(p)
            else:
                ready.append(p)
        if ready:
            self.host.free(ready)
        self.landing.extend(later.values())

    def reap_host_frees(self, wait: bool = False, need: int = 0) -> int:
        """Free the host pages whose landing copy is done; returns the pages freed. `wait`: wait for every copy;
        `need`: then wait for copies, oldest first, only until that many host pages are free. A copy fills pages that
        the forward queued before it computes, so waiting for the newest ones stalls the engine thread until the GPU
        has caught up with it (hundreds of milliseconds a step under write pressure); the oldest have landed or
        nearly."""
        freed, keep = 0, []
        for handle, pages in self.landing:
            if handle.done():
                self.host.free(pages)
                freed += len(pages)
            else:
                keep.append((handle, pages))
        self.landing = keep
        if not wait and self.host.allocator.free_pages >= need:
            return freed
        start = _clock()
        while self.landing and (wait or self.host.allocator.free_pages < need):
            handle, pages = self.landing.pop(0)
            handle.wait()
            self.host.free(pages)
            freed += len(pages)
        self.stats.host_free_wait_s += _clock() - start
        return freed

    def host_census(self) -> dict[str, int]:
        """Host pages by why they can or cannot leave now, for the report of a full host tier: free, landing (freed,
        a copy still lands), loading (an L3 read fills them), then each host node's pages under the first that
        applies: writing (an L3 write reads them), prefetched (held for a queued request), pinned (other pins of
        their own), copying (a copy to the GPU still reads them), locked (a request's prefix not on the GPU),
        unwritten (not in L3: leaving drops them) and evictable (in L3 too). O(nodes): for reports, not per step."""
        census = dict.fromkeys(("free", "landing", "loading", "writing", "prefetched", "pinned", "copying", "locked",
                                "unwritten", "evictable"), 0)
        census["free"] = self.host.allocator.free_pages
        census["landing"] = sum(len(pages) for _, pages in self.landing)
        t = self.transfers
        census["loading"] = sum(len(t.reading(node).host_pages) for node in t.loading.values())
        for node in self.tree.nodes():
            if not node.on_host:
                continue
            if node.id in t.writing and node.id not in t.bounced:
                why = "writing"
            elif node.own_pins > 0:
                why = "prefetched" if t.prefetched(node) else "pinned"
            elif node.lock_ref > 0 and not t.ready(node):
                why = "copying"
            elif node.lock_ref > 0 and not node.on_device:
                why = "locked"
            elif not node.on_disk:
                why = "unwritten"
            else:
                why = "evictable"
            census[why] += node.num_pages
        return census

    def landing_host_pages(self) -> list[int]:
        """Host pages freed by the tree whose copy has not landed yet (owned by nobody, not yet free)."""
        return [p for _, pages in self.landing for p in pages]

    def free_device_pages(self, pages: Sequence[int]) -> None:
        """Free tree-owned GPU pages. Compute may overwrite them next, so the current stream first waits
        (on the GPU; the host does not block) for any GPU -> host copy still reading them. Only those
        copies: waiting for every copy in flight made each eviction wait for the newest backups too."""
        waits = {}
        backups = self.transfers.backups
        busy = InFlight()
        for p in pages:
            handle = backups.pop(p, None)
            if handle is not None and busy(handle):
                waits[id(handle)] = handle
                self.stats.backup_waits += 1
        for handle in waits.values():
            wait = getattr(handle, "stream_wait", None)
            if wait is not None:
                wait()
            else:
                handle.wait()
        self.device.free(pages)

    def make_disk_room(self, n: int, writing: TreeNode | None = None) -> bool:
        """Evict L3 leaves until n more pages fit under the disk capacity. `writing`: the node the room is for; its
        ancestors stay (an ancestor only on disk is an L3 leaf while the node is not written yet, and evicting it
        would take the node, its prefix gone, out of the tree). With shares, room for a share group over its own
        comes only from its pages and those of groups over theirs (see `evict`). A node whose L3 read is in flight
        stays."""
        if n > self.disk_capacity:
            return False
        if self._disk_over(n) <= 0:
            return True  # room already: no path to walk
        groups, strict = self.tree.quota_victims(DISK, writing.group if writing is not None else None, n)
        path: set[int] = set()
        while writing is not None:
            path.add(writing.id)
            writing = writing.parent
        # nor a node whose read is in flight: its bytes are being read, and its completion finds it in the tree (a
        # prefetch whose request was admitted without it, or left, no longer pins it)
        reading = self.transfers.disk_load
        skip = lambda node: node.id in path or reading(node) is not None  # noqa: E731
        while (over := self._disk_over(n)) > 0:
            node = self.tree.pop_evictable(DISK, skip, groups)
            if node is None and groups is not None and not strict:
                groups = None
                continue
            if node is None:
                return False
            self.evict_node(DISK, self._tail(node, over))
        return True

    def _disk_over(self, n: int) -> int:
        """Pages by which n more on disk would exceed its capacity (pages on disk and queued for it count)."""
        return self.tree.pages_in[2] + self.disk_inflight + n - self.disk_capacity

    def free_nodes(self, nodes: Sequence[TreeNode]) -> None:
        """Free every page of nodes the tree removed, in every tier."""
        for node in nodes:
            self.hook.removed(node)
            if node.on_device:
                self.free_device_pages(node.device_pages)
                self.stats.evictions[DEVICE] += node.num_pages
            if node.on_host:
                self.free_host_pages(node.host_pages)
                self.stats.evictions[HOST] += node.num_pages
            if node.on_disk:
                self.l3.delete(node.disk_keys, wait=False)
                self.stats.evictions[DISK] += node.num_pages
            node.drop_locations()
            self.transfers.forget(node)

    def remove_invalid(self) -> None:
        """Remove the nodes whose data proved bad, with their subtrees, once nobody locks or pins them."""
        for node in list(self.transfers.invalid.values()):
            if node.lock_ref > 0 or node.pin_ref > 0:
                continue
            self.transfers.forget(node)
            if not node.removed:
                self.free_nodes(self.tree.remove_subtree(node))


class _HostPicks:
    """The host copies one eviction takes, in turn: the lowest-priority leaf whose L3 write is not pending; else a
    host copy above held ones that L3 has (radix.tree); else any leaf, even one whose write waits for the queue (it
    is dropped). Under write pressure the host tier is full of new pages waiting for the disk and of the prefixes
    above them: dropping the new pages while copies of bytes that L3 holds stayed lost them for good, and the engine
    then waited for their GPU -> host copies to land. Where the leaf is the host copy of GPU pages that L3 lacks, a
    copy above held ones goes first while there is one: those GPU pages are copied back when they leave the GPU, and
    freeing them waits for that copy (with the host full of pages waiting for the disk, every GPU eviction waited on
    the copy queue: bench/RESULTS.md, 'Offline replay').

    The copies above held ones come from one iteration of `RadixTree.evictable_interiors` per eviction, not one per
    node taken: an eviction that frees a step's pages takes dozens of small nodes, and a scan of the host nodes for
    each was most of the engine thread's scheduling time with an L3 (bench/RESULTS.md, 'The disk adds its
    bandwidth'). Before the last resort (a pending write's leaf) a fresh iteration looks once more, for a node that
    became a candidate meanwhile. Likewise the leaves passed over are not popped and pushed back at each node taken:
    those with a copy still landing in them are set aside for the eviction, and those whose L3 write waits stay out
    of the host order until it stops waiting (the write mechanism requeues them) or the last resort needs them. With
    thousands of writes waiting for a slow disk, popping them at every eviction was most of a replay's time."""

    def __init__(self, tree: RadixTree, write_pending: Callable[[TreeNode], bool],
                 pending_nodes: Callable[[], Iterable[TreeNode]]):
        self.tree = tree
        self.pending = write_pending
        self.pending_nodes = pending_nodes
        self._interiors: Iterator[TreeNode] | None = None
        self._groups: list[int] | None = None
        self._passed: list[TreeNode] = []  # leaves passed over, out of the host order until `done`
        self._spare_gpu_copies = True  # a copy above held ones goes before a host copy of GPU pages L3 lacks

    def _interior(self, skip: Callable[[TreeNode], bool] | None, groups: list[int] | None,
                  fresh: bool) -> TreeNode | None:
        """The next host copy above held ones from this eviction's iteration, or from a `fresh` one."""
        if fresh:
            outside = ((lambda n: (skip is not None and skip(n)) or n.group not in groups) if groups is not None
                       else skip)
            self._interiors, self._groups = self.tree.evictable_interiors(outside), groups
        elif not self._iterating(groups):
            return None
        assert self._interiors is not None
        return next(self._interiors, None)

    def _iterating(self, groups: list[int] | None) -> bool:
        """Whether this eviction has an iteration of the copies above held ones for these share groups."""
        return self._interiors is not None and groups == self._groups

    def done(self) -> None:
        """The eviction is over: the leaves passed over go back into the host order, but those whose write still
        waits."""
        pending = self.pending
        for node in self._passed:
            if not pending(node):
                self.tree.requeue(node)
        self._passed.clear()

    def next(self, skip: Callable[[TreeNode], bool] | None,
             groups: list[int] | None = None) -> tuple[TreeNode | None, bool]:
        """(node, whether it is an interior host copy), or (None, False) when nothing may go."""
        pending = self.pending
        node = self.tree.pop_evictable(HOST, lambda n: (skip is not None and skip(n)) or pending(n), groups,
                                       self._passed)
        if node is not None:
            if self._spare_gpu_copies and node.on_device and not node.on_disk:
                above = self._interior(skip, groups, fresh=not self._iterating(groups))
                if above is not None:
                    return above, True  # the GPU copy stays at the top of the order, for when none is left
                self._spare_gpu_copies = False
            return node, False
        node = self._interior(skip, groups, fresh=False)
        if node is None:  # the first look of this eviction, or the last before its last resort
            node = self._interior(skip, groups, fresh=True)
        if node is not None:
            return node, True
        self.done()
        for node in self.pending_nodes():  # the last resort may take a leaf whose write waits: all back in the order
            self.tree.requeue(node)
        return self.tree.pop_evictable(HOST, skip, groups), False


class _DevicePicks:
    """The GPU copies one eviction takes, in turn: the lowest-priority leaf whose pages can be freed without waiting for
    a copy; up to COPY_LOOKAHEAD leaves that would wait (`Eviction._waits_for_copy`) are passed over, then, once no
    other leaf is left or that many were passed, the leaves are taken in order. Passed leaves are set aside for the
    eviction and go back into the GPU order when it is done."""

    def __init__(self, tree: RadixTree, waits: Callable[[TreeNode], bool]):
        self.tree = tree
        self.waits = waits
        self._passed: list[TreeNode] = []
        self._looked = 0  # leaves passed over for a copy so far

    def done(self) -> None:
        for node in self._passed:
            self.tree.requeue(node)
        self._passed.clear()

    def _passes(self, node: TreeNode) -> bool:
        if self._looked < COPY_LOOKAHEAD and self.waits(node):
            self._looked += 1
            return True
        return False

    def next(self, skip: Callable[[TreeNode], bool] | None,
             groups: list[int] | None = None) -> tuple[TreeNode | None, bool]:
        """(node, False), or (None, False) when nothing may go."""
        if self._looked < COPY_LOOKAHEAD:
            node = self.tree.pop_evictable(DEVICE, lambda n: (skip is not None and skip(n)) or self._passes(n),
                                           groups, self._passed)
            if node is not None or not self._looked:
                return node, False
            self._looked = COPY_LOOKAHEAD  # only leaves that wait are left: in order from here
            self.done()
        return self.tree.pop_evictable(DEVICE, skip, groups), False
