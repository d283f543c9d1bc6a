"""GPU -> host copies ("backups") under the `to_host` write policy, and the deferred write-through backlog.

Under `DeferredWriteThrough` the copies of newly computed pages wait while the GPU pool has room to spare and start
in slices of FLUSH_SLICE_BYTES per engine step once it fills, when the engine idles, or when a waiting page leaves
the GPU. Every batch of copies (a slice of the backlog, the nodes one commit produced) goes to the copier as one
call: the copier's cost on the engine thread is per call and per staging chunk, and a backlog of small nodes (decode
pages, chunked-prefill parts) copied one node at a time launched 4-5 times as many CUDA operations as the pages
needed (bench/RESULTS.md, 'No-reuse overhead'). `Writes` (controller/writes.py) adds the host -> L3 side.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

from controller.eviction import Eviction
from controller.ports import Copier, HostTier, Pool
from controller.reuse import ReuseFilter
from controller.stats import CacheStats
from controller.transfers import Transfers
from controller.write_policies import TierWrites
from radix import DEVICE, HOST, RadixTree, TreeNode
from tiers.copy import COMPLETED, TransferHandle

logger = logging.getLogger(__name__)

# a full host tier refusing backups is reported (with the host census) at most this often
HOST_FULL_REPORT_S = 10.0

# A deferred write-through backlog starts at most about this many bytes per engine step (`begin_step`). Starting
# a whole backlog at once (24 GB after a 32k-token burst on the H200) queued thousands of copy operations: the
# engine thread then blocked in CUDA launches until the copy engines drained. 1 GiB is ~20 ms of PCIe 5 copying.
FLUSH_SLICE_BYTES = 1 << 30


class HostBackups:
    """GPU -> host copies of tree nodes, one copier call per batch (see the module doc)."""

    def __init__(self, tree: RadixTree, device: Pool, host: HostTier, copier: Copier, eviction: Eviction,
                 transfers: Transfers, stats: CacheStats, to_host: TierWrites, page_bytes: int,
                 reuse: ReuseFilter | None = None):
        self.tree = tree
        self.device = device
        self.host = host
        self.copier = copier
        self.eviction = eviction
        self.transfers = transfers
        self.stats = stats
        self.to_host = to_host
        self.page_bytes = page_bytes
        # which pages are likely read again (controller/reuse.py): deferred copies and the L3's admission ask it
        self.reuse = reuse if reuse is not None else ReuseFilter("all")
        self.deferred: deque[TreeNode] = deque()  # committed nodes whose copy to host waits (oldest first)
        self._deferred_prune_at = 2 * device.capacity_pages  # `defer` drops the nodes gone past this length
        self.flush_slice_pages = max(1, FLUSH_SLICE_BYTES // max(1, page_bytes))  # see FLUSH_SLICE_BYTES
        self._flush_budget = self.flush_slice_pages  # backlog pages this step may still start (begin_step renews)
        self._host_full_reported = float("-inf")

    def copied_to_host(self, node: TreeNode, handle: TransferHandle) -> None:
        """A node's host copy was started (`handle` completes it): the L3 side may write it on (Writes)."""

    # ------------------------------------------------------------------ deferred write-through

    def deferring(self) -> bool:
        """Whether new commit-time copies wait: the policy defers, and the GPU pool has room to spare or the traffic
        is one-off prompts (controller/reuse.py, `one_off`). Then the backlog is copied neither while the engine is
        busy nor while it idles (`flush_slice`), until the traffic reuses again; a waiting node that leaves
        the GPU first is dropped uncopied unless it is likely read again (`_copies_on_leaving_gpu`). Copying every
        new page of one-off prompts cost the engine thread launches and the host tier churn for bytes nobody reads
        (bench/RESULTS.md, 'No-reuse overhead')."""
        t = self.to_host
        if not t.defers:
            return False
        return (self.device.allocator.free_pages > t.defer_above_free * self.device.capacity_pages
                or self.reuse.one_off())

    def defer(self, nodes: Sequence[TreeNode]) -> None:
        """Queue committed nodes' copies; nodes at the queue's head that left the tree are forgotten first, so that a
        backlog not copied for a long time (traffic without reuse) holds no more than the GPU does."""
        deferred = self.deferred
        while deferred and deferred[0].removed:
            deferred.popleft()
        if len(deferred) > self._deferred_prune_at:  # a head that stays (a pinned prefix) holds the rest back
            self.deferred = deferred = deque(n for n in deferred if not n.removed)
            self._deferred_prune_at = 2 * max(len(deferred), self.device.capacity_pages)
        deferred.extend(nodes)
        self.stats.deferred_pages += sum(n.num_pages for n in nodes)

    def begin_step(self) -> None:
        """The engine starts a step: renew the step's slice of the deferred backlog (`flush_slice_pages`)."""
        self._flush_budget = self.flush_slice_pages

    def allocated(self) -> None:
        """GPU pages were handed out: once the pool is no longer roomy, start this step's slice of the backlog."""
        if self.deferred and not self.deferring():
            self.flush_slice()

    def flush_slice(self) -> None:
        """Start what is left of this step's slice of the deferred backlog; nothing while the traffic is one-off
        prompts (`deferring`): copying a burst's pages between bursts took the engine thread tens of milliseconds a
        slice, and the next burst could arrive meanwhile (bench/RESULTS.md, 'No-reuse overhead')."""
        if self.deferred and self._flush_budget > 0 and not self.reuse.one_off():
            self._flush_budget -= self.flush_backups(self._flush_budget)

    def flush_backups(self, limit: int | None = None) -> int:
        """Start deferred copies, oldest first, until `limit` pages (whole nodes; None: all) have started;
        returns the pages copied.

        A queued node may have been split since (its upper part is then an ancestor, which may still wait
        after the lower part was evicted), evicted, or copied already. So each queued node's path is walked
        up to the first GPU node with a host copy, or to one already in the batch.
        """
        copied = 0
        while self.deferred and (limit is None or copied < limit):
            batch: list[TreeNode] = []
            taken: set[int] = set()
            planned = 0
            while self.deferred and (limit is None or copied + planned < limit):
                chain = []
                walk: TreeNode | None = self.deferred.popleft()
                while (walk is not None and not walk.removed and walk.id not in taken
                       and (not walk.on_device or not walk.on_host)):
                    if walk.on_device:
                        chain.append(walk)
                    walk = walk.parent
                chain.reverse()  # parents first: the order the tree's copies were made in one at a time
                batch.extend(chain)
                taken.update(n.id for n in chain)
                planned += sum(n.num_pages for n in chain)
            copied += self.backup_nodes(batch)
        return copied

    # ------------------------------------------------------------------ the copies

    def backup_to_host(self, node: TreeNode) -> bool:
        """Copy a node's GPU pages to new host pages; False (counted) if the host is full."""
        if node.on_host or not node.on_device:
            return node.on_host
        return self.backup_nodes([node]) > 0

    def backup_nodes(self, nodes: Sequence[TreeNode]) -> int:
        """Copy the GPU pages of each node that has no host copy yet to new host pages, all in one copier call;
        returns the pages copied. A node the host has no room for is left out (counted as `host_full`)."""
        planned: list[tuple[TreeNode, list[int]]] = []
        for node in nodes:
            if node.on_host or not node.on_device:
                continue
            if self.transfers.failed(node) or not self.transfers.ready(node):
                continue  # its own load is in flight (or failed): nothing to back up yet
            n = node.num_pages
            host_pages = self.eviction.allocate(HOST, n, protect=node, group=node.group)
            if host_pages is None:
                self.stats.drops["host_full"] += n
                self._report_host_full(n)
                continue
            planned.append((node, host_pages))
        if not planned:
            return 0
        device_pages = [p for node, _ in planned for p in node.device_pages]
        host_pages = [p for _, pages in planned for p in pages]
        handle = self.copier.to_host(device_pages, host_pages)
        if handle is not COMPLETED:
            self.transfers.backups.update(dict.fromkeys(device_pages, handle))
            self.transfers.host_fills.update(dict.fromkeys(host_pages, handle))
        for node, pages in planned:
            self.tree.set_location(node, HOST, pages)
            self.stats.moved(DEVICE, HOST, node.num_pages, self.page_bytes)
            self.copied_to_host(node, handle)
        return len(host_pages)

    def _report_host_full(self, n: int) -> None:
        """Say why the host tier had no room for a backup (rate-limited): what holds its pages."""
        now = time.monotonic()
        if now - self._host_full_reported < HOST_FULL_REPORT_S:
            return
        self._host_full_reported = now
        census = self.eviction.host_census()
        logger.warning("host tier full: a GPU -> host copy of %d pages found no room (host_full drops so far: %d "
                       "pages); host pages now: %s; %s", n, self.stats.drops["host_full"],
                       ", ".join(f"{k} {v}" for k, v in census.items() if v), self._host_full_detail())

    def _host_full_detail(self) -> str:
        """What the host-full report adds about the tiers below (Writes: the L3 writes waiting)."""
        return "no L3 writes waiting"

    def _host_copy_pays(self, node: TreeNode) -> bool:
        """Whether a node still on the GPU should get a host copy now (leaving the GPU, or hit again). A node
        the L3 holds gets one only in free host pages: evicting other host pages for it trades one cached copy
        for another and costs a copy. Under load that churn (a running prefix's host copy evicted for new pages,
        then copied back when the prefix left the GPU) cost the engine thread ~10 s of a 60 s run."""
        return not node.on_disk or self.host.allocator.free_pages >= node.num_pages

    def _copies_on_leaving_gpu(self, node: TreeNode) -> bool:
        """Whether a node leaving the GPU gets a host copy first; freeing its pages waits for it and every copy queued
        before it. A deferred commit-time copy is made so only while the traffic reuses or the node is likely read
        again (controller/reuse.py): no-reuse traffic made every GPU eviction wait for copies of bytes nobody reads
        (bench/RESULTS.md, 'No-reuse overhead'). Write-back's copy on leaving, its only one, is always made: that share
        misjudges traffic like the Mooncake sample's, and gating it halved the sample's host hits."""
        return (not node.on_host and self.to_host.on_evict(node) and self._host_copy_pays(node)
                and (not self.to_host.defers or self.reuse.traffic_reuses() or self.reuse.likely(node)))
