"""Writes: copying pages down a tier (GPU -> host, host -> L3), under a write policy per tier.

A policy is a strategy object (controller/write_policies.py) that answers three events for a node: it was just
computed (`on_commit`), it was hit again (`on_hit`), or it is about to leave its tier (`on_evict`):
- `WriteThrough` copies at commit, and again on a hit where an earlier copy was refused;
- `DeferredWriteThrough` (GPU -> host only) queues commit-time copies while the GPU pool has room to
  spare, starts them in slices once it fills, when the engine idles, or on eviction;
- `SelectiveWriteThrough` copies once a node has been hit `hits` times;
- `WriteBack` copies on eviction;
- `NoWrites` stands for a tier that is absent.

GPU -> host copies are `HostBackups`' (controller/backups.py), the base class; host -> L3 writes go through the L3
worker's bounded queue. A node larger than the largest write the queue takes is split and written in parts. A write
the full queue refuses waits, oldest first, until the queue has room (`drain_waiting`, each poll): bursts of new
pages (a long first prompt) outrun the disk for a while without losing their writes. Only a page that leaves host memory
before its turn comes is dropped then, as `l3_queue_full`. A write that cannot be made is dropped and counted in
`stats.drops` by reason: `host_full`, `l3_queue_full`, `disk_full`, `l3_gone` (the L3 process died), `not_reused`
(nothing suggests it will be read again, and the disk has no bandwidth to spare: `WritePolicy.l3_admit`,
controller/reuse.py), `l3_backlog` (the writes waiting for the disk already hold WAITING_PER_STAGED times their
share of host memory, `WritePolicy.l3_host_share`, and more than the host pool has free: a backlog is a rate, so
a near-empty disk drops one when commits outrun its writes and host memory is needed), `ancestor_gpu_only` (a page
above it is only on the GPU and cannot be backed up to host: the write's pin would hold it there), and for what the
L3 store refuses `not_admitted`
(its admission rule, `cache.l3.admission_hits`), `l3_busy`, `l3_degraded` or `l3_write_failed`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from controller.backups import HostBackups
from controller.eviction import Eviction
from controller.ports import L3, Copier, HostTier, Pool, Worker, page_buffers
from controller.reuse import ReuseFilter
from controller.stats import CacheStats
from controller.transfers import AllTransfers, InFlight, Transfers
from controller.write_policies import TierWrites
from radix import DEVICE, DISK, HOST, RadixTree, TreeNode
from tiers.copy import TransferHandle
from tiers.l3.worker import Completion

logger = logging.getLogger(__name__)

# L3 writes waiting for their turn (unpinned, but leaving host memory last) hold at most this many times the host
# pages queued writes may pin (WritePolicy.l3_host_share); past that a write is dropped as `l3_backlog`
WAITING_PER_STAGED = 2

# spare-bandwidth writes remembered for later at most (a node each; stale ones are skipped when their turn comes)
SPARE_LATER_NODES = 4096

# the store's reasons for refusing a page (L3Store.write_pages_detailed) -> the drop they are counted as
WRITE_REFUSALS = {"not_admitted": "not_admitted", "busy": "l3_busy", "degraded": "l3_degraded"}

class Writes(HostBackups):
    """The write mechanism under two strategies, `to_host` and `to_disk` (see the module doc)."""

    def __init__(self, tree: RadixTree, device: Pool, host: HostTier, l3: L3, copier: Copier,
                 worker: Worker, eviction: Eviction, transfers: Transfers, stats: CacheStats,
                 to_host: TierWrites, to_disk: TierWrites, page_bytes: int, staging_share: float = 1.0,
                 reuse: ReuseFilter | None = None):
        super().__init__(tree, device, host, copier, eviction, transfers, stats, to_host, page_bytes, reuse)
        self.l3 = l3
        self.worker = worker
        self.to_disk = to_disk
        # host pages that queued L3 writes may pin (WritePolicy.l3_host_share): the rest of host memory stays room
        # for GPU -> host copies and reads, however slowly the disk drains its queue
        self.staging_pages = max(1, int(staging_share * host.capacity_pages))
        # the largest write the L3 queue takes whole: a larger node is written in parts
        self.max_write_pages = max(1, min(worker.queue_pages, self.staging_pages))
        # nodes whose L3 write waits for room in the queue, oldest first, and the ids of every node (split parts
        # included) still waiting: see the module doc
        self.waiting_disk: deque[TreeNode] = deque()
        self._waiting: dict[int, TreeNode] = {}
        self._waiting_pages = 0  # their pages (a split moves pages between two of them: the sum stays)
        # nodes without a likely reader whose write found no spare room: written, newest first, once the disk has
        # room again (`drain_spare`, each poll), forgotten when they leave host memory (controller/reuse.py)
        self._spare: OrderedDict[int, TreeNode] = OrderedDict()
        tree.split_listeners.append(self._split)
        eviction.hook = self
        eviction.write_pending = lambda node: node.id in self._waiting
        eviction.pending_nodes = lambda: list(self._waiting.values())

    # ------------------------------------------------------------------ events

    def committed(self, nodes: Sequence[TreeNode], continues_hit: bool = False) -> None:
        """Newly computed nodes entered the tree: back them up now, or queue them while the GPU has room.
        `continues_hit`: the request that computed them started with a cached prefix (see controller/reuse.py)."""
        self.reuse.computed(nodes, continues_hit)
        nodes = [n for n in nodes if self.to_host.on_commit(n)]
        if not nodes:
            return
        if self.deferring():
            self.defer(nodes)
            return
        self.flush_slice()
        self.backup_nodes(nodes)

    def hit(self, nodes: Sequence[TreeNode]) -> None:
        """A request used these nodes: copies the policies make on hits, and retries of refused write-through."""
        for node in nodes:
            if (not node.on_host and node.on_device and self.to_host.on_hit(node) and not self.deferring()
                    and self._host_copy_pays(node)):
                self.backup_to_host(node)
            if node.on_host and not node.on_disk and self.to_disk.on_hit(node):
                if self.to_disk.counts_hits:
                    note = getattr(self.l3, "note_hit", None)
                    if note is not None:
                        note(node.keys)
                self.write_to_disk(node)

    def evicting(self, tier: str, node: TreeNode) -> None:
        """EvictionHook: the last chance to copy a node's pages down before they leave `tier`."""
        if tier == DEVICE:
            if self._copies_on_leaving_gpu(node) and self.backup_to_host(node):
                self.stats.eviction_backups += node.num_pages  # freeing its pages waits for this copy
        elif tier == HOST:
            if not node.on_disk and node.id not in self.transfers.writing and self.to_disk.on_evict(node):
                self.write_to_disk(node, bounce=True)
            if self._unwait(node):  # its turn in the L3 queue did not come in time
                if not node.on_disk and node.id not in self.transfers.writing:
                    self.stats.drops["l3_queue_full"] += node.num_pages
            if self._spare.pop(node.id, None) is not None and not node.on_disk \
                    and node.id not in self.transfers.writing:
                self.stats.drops["not_reused"] += node.num_pages  # no spare room came in time

    def copies_before_leaving(self, tier: str, node: TreeNode) -> bool:
        """EvictionHook: whether `evicting` copies the node down first. Only a deferred GPU -> host copy counts: the
        engine waits for it (and the copies queued before it) to free the GPU pages. Under write-back every node is
        copied when it leaves, and the order of leaving cannot spare a copy."""
        return tier == DEVICE and self.to_host.defers and self._copies_on_leaving_gpu(node)

    def removed(self, node: TreeNode) -> None:
        """EvictionHook: a node removed with an ancestor leaves the writes waiting for the queue."""
        if self._unwait(node) and not node.on_disk:
            self.stats.drops["l3_queue_full"] += node.num_pages  # removed before its turn

    def _split(self, upper: TreeNode, lower: TreeNode) -> None:
        if lower.id in self._waiting:
            self._waiting[upper.id] = upper
        if lower.id in self._spare:
            self._spare[upper.id] = upper

    # ------------------------------------------------------------------ host -> L3

    def copied_to_host(self, node: TreeNode, handle: TransferHandle) -> None:
        """HostBackups: a node's host copy was started; a policy writing at commit writes it on once it lands."""
        if self.to_disk.on_commit(node):
            self.write_to_disk(node, handle)

    def _host_full_detail(self) -> str:
        return f"L3 writes waiting for the queue: {self.waiting_disk_pages} pages"

    def write_to_disk(self, node: TreeNode, handle: TransferHandle | None = None, bounce: bool = False) -> bool:
        """Queue L3 writes of a node's host pages, in parts of at most `max_write_pages`; True if all of it is
        on disk or queued. Without `bounce` each part stays pinned in host memory until its write completes;
        with it the bytes are copied first so the host pages can be freed now."""
        if node.on_disk or node.id in self.transfers.writing or not node.on_host:
            return node.on_disk
        if node.id in self._waiting and not bounce:
            return False  # it waits its turn (drain_waiting)
        spare = not self.reuse.likely(node)  # written only with bandwidth to spare (controller/reuse.py)
        if spare and not self._spare_room(bounce):
            if bounce or not self.reuse.traffic_reuses():
                self.stats.drops["not_reused"] += node.num_pages
            else:
                self._defer_spare([node])
            return False
        self._spare.pop(node.id, None)
        if handle is None:  # a write asked for later (a hit, an eviction) may still find its host copy landing
            handle = self._copy_in_flight(node)
        parts = []
        while node.num_pages > self.max_write_pages:
            parts.append(self.tree.split(node, self.max_write_pages))  # the upper part: the first pages
        parts.append(node)
        for i, part in enumerate(parts):
            refused = self._write_part(part, handle, bounce)
            if refused == "l3_queue_full" and spare:  # no spare bandwidth after all: later, if any comes
                self._defer_spare(parts[i:])
                return False
            if refused == "l3_queue_full" and not bounce:  # this part and the rest wait for room
                rest = sum(p.num_pages for p in parts[i:])
                over = self.waiting_disk_pages + rest - WAITING_PER_STAGED * self.staging_pages
                if over > 0 and over > self.host.allocator.free_pages:
                    # the disk is this far behind: pages waiting for it would hold host memory (they leave it last)
                    # that caching needs, for as long as the disk takes. Past their share they may only hold what
                    # is free now: a burst of commits outran a disk that drains in moments, and free memory held
                    # by its writes costs caching nothing
                    self.stats.drops["l3_backlog"] += rest
                    return False
                self.waiting_disk.extend(parts[i:])
                for p in parts[i:]:
                    if self._waiting.setdefault(p.id, p) is p:
                        self._waiting_pages += p.num_pages
                return False
            if refused is not None:  # the parts after it would be refused the same way
                self.stats.drops[refused] += sum(p.num_pages for p in parts[i:])
                return False
        return True

    def _spare_room(self, bounce: bool) -> bool:
        """Whether a write without a likely reader may start now (controller/reuse.py): the traffic reuses, no likely
        write waits for the disk, and queued writes fill less than half the write queue and half the host pages
        they may pin. Its parts then go while the queue takes them; the rest is remembered (`_defer_spare`), never
        left waiting in the queue."""
        return (not bounce and not self.waiting_disk and self.reuse.traffic_reuses()
                and self.worker.queued_write_pages < self.worker.queue_pages // 2
                and self.eviction.disk_inflight < self.staging_pages // 2)

    def _defer_spare(self, nodes: Sequence[TreeNode]) -> None:
        """Remember nodes whose spare-bandwidth write found no room, newest last; past SPARE_LATER_NODES the oldest
        are given up (counted as not_reused)."""
        for node in nodes:
            self._spare[node.id] = node
            self._spare.move_to_end(node.id)
        while len(self._spare) > SPARE_LATER_NODES:
            _, old = self._spare.popitem(last=False)
            if not old.removed and old.on_host and not old.on_disk:
                self.stats.drops["not_reused"] += old.num_pages

    def drain_spare(self) -> int:
        """Write remembered spare-bandwidth nodes, newest first (the latest session turn is the likeliest to be
        continued while still in host memory), while the disk has spare room; returns the pages queued."""
        queued = 0
        while self._spare and self._spare_room(False):
            _, node = self._spare.popitem(last=True)
            if node.removed or node.on_disk or not node.on_host or node.id in self.transfers.writing:
                continue
            before = self.eviction.disk_inflight
            self.write_to_disk(node)
            if self.eviction.disk_inflight == before:
                break  # refused after all (remembered again): the room is not there yet
            queued += self.eviction.disk_inflight - before
        return queued

    def _path_off_gpu(self, node: TreeNode) -> bool:
        """Whether every ancestor of `node` has a copy off the GPU, backing up to host those that have none first;
        False if one cannot be (no host room), or the node lost its host copy meanwhile. A write pins its node's
        path (a parent outlives its children), and a pin on a page whose only copy is on the GPU holds it there for
        as long as the disk takes: with a slow disk, writes held the GPU pool and starved the running requests."""
        chain = []
        up = node.parent
        while up is not None and not up.base:
            if not up.on_host and not up.on_disk:
                chain.append(up)
            up = up.parent
        if not chain:
            return True
        self.tree.pin(node)  # the room made for its parents' host copies is not made from its own
        try:
            return all(self.backup_to_host(ancestor) for ancestor in reversed(chain)) and node.on_host
        finally:
            self.tree.unpin(node)

    def drain_waiting(self) -> int:
        """Queue the waiting L3 writes, oldest first, while the queue has room; returns the pages queued."""
        queued = 0
        worker = self.worker
        while self.waiting_disk:
            node = self.waiting_disk[0]
            parts = [node]  # with the parts split off above it since, top-down
            while (up := parts[0].parent) is not None and up.id in self._waiting:
                parts.insert(0, up)
            for part in parts:
                if part.id not in self._waiting:
                    continue
                if part.removed or part.on_disk or part.id in self.transfers.writing or not part.on_host:
                    self._unwait(part)
                    if part.removed and not part.on_disk:  # removed with an ancestor before its turn
                        self.stats.drops["l3_queue_full"] += part.num_pages
                    continue
                if (worker.queued_write_pages + part.num_pages > worker.queue_pages
                        or self.eviction.disk_inflight + part.num_pages > self.staging_pages):
                    return queued  # still no room: it stays first in line
                refused = self._write_part(part, self._copy_in_flight(part), bounce=False)
                if refused == "l3_queue_full":  # the worker's own queue is full after all: wait on
                    return queued
                self._unwait(part)
                if refused is not None:
                    self.stats.drops[refused] += part.num_pages
                else:
                    queued += part.num_pages
            self.waiting_disk.popleft()
        return queued

    def finish(self, poll: Callable[[], None]) -> None:
        """Shutdown: start the deferred backups (and so their L3 write-through, as far as the L3 queue takes them)
        and finish every queued L3 write; `poll` applies finished I/O (TierController.poll)."""
        if self.deferred:
            self.flush_backups()
        self.worker.wait_idle()
        poll()
        while self.waiting_disk:  # writes waiting for queue room: each round, the empty queue takes more
            waiting = self.waiting_disk_pages
            self.worker.wait_idle()
            poll()
            if self.waiting_disk_pages >= waiting:  # no progress (the worker refuses): they are lost
                self.drop_waiting()
                break

    def drop_waiting(self) -> None:
        """Give up the waiting writes (shutdown, the queue making no progress), counted as l3_queue_full."""
        self.stats.drops["l3_queue_full"] += self.waiting_disk_pages
        self.waiting_disk.clear()
        waited, self._waiting = list(self._waiting.values()), {}
        self._waiting_pages = 0
        for node in waited:
            if not node.removed:
                self.tree.requeue(node)

    def _unwait(self, node: TreeNode) -> bool:
        """Take a node out of the writes waiting for the queue (its pages out of the count); False if it was not
        waiting."""
        if self._waiting.pop(node.id, None) is None:
            return False
        self._waiting_pages -= node.num_pages
        if not node.removed:
            self.tree.requeue(node)  # host eviction may have left it out of its order while it waited
        return True

    @property
    def waiting_disk_pages(self) -> int:
        """Pages whose L3 write waits for room in the queue (kept as a count: the write path asks each time it
        queues). A waiting node leaves the count when it leaves host memory (`evicting`) or its turn comes."""
        return self._waiting_pages

    def check_integrity(self) -> None:
        """The count of waiting pages is the sum over the waiting nodes."""
        exact = sum(n.num_pages for n in self._waiting.values())
        if exact != self._waiting_pages:
            raise AssertionError(f"L3 writes waiting: {self._waiting_pages} pages counted, {exact} in the nodes")

    def _copy_in_flight(self, node: TreeNode) -> TransferHandle | None:
        """The GPU -> host copies that fill this node's host pages and have not landed yet, as one handle (None:
        none). The L3 checksums and writes the host pages: read before the copy lands, the stored checksum
        would not match the stored bytes (or, staged, the wrong bytes would be stored). Freeing the node's GPU
        pages does not end the copy for the host: it only makes the GPU wait for it."""
        fills = self.transfers.host_fills
        busy = InFlight()
        pending = {id(h): h for p in node.host_pages if (h := fills.get(p)) is not None and busy(h)}
        if not pending:
            return None
        return next(iter(pending.values())) if len(pending) == 1 else AllTransfers(list(pending.values()))

    def _write_part(self, node: TreeNode, handle: TransferHandle | None, bounce: bool) -> str | None:
        """Queue one write of at most `max_write_pages`; None, or the reason it was refused."""
        n = node.num_pages
        # a full queue refuses the write: found out first, before disk pages are evicted to make room for it and
        # before one page view (or, bouncing, one copy) per page is made, all for nothing
        if self.worker.queued_write_pages + n > self.worker.queue_pages:
            return "l3_queue_full"
        if not bounce and self.eviction.disk_inflight + n > self.staging_pages:
            return "l3_queue_full"  # the host pages it would pin are over the writes' share: wait (unpinned)
        if not bounce and not self._path_off_gpu(node):
            return "ancestor_gpu_only"
        if not self.eviction.make_disk_room(n, node):
            return "disk_full"
        if handle is not None and bounce:
            handle.wait()
        pages = page_buffers(self.host, node.host_pages)
        if bounce:
            staged = self.worker.stage(pages)  # copies the write owns; None: no room for them
            if staged is None:
                return "l3_queue_full"
            pages = staged
        before = handle.wait if handle is not None and not bounce else None
        if not self.worker.submit_write(node, node.keys, pages, before):
            return self.worker.refusal
        self.transfers.writing[node.id] = node
        if bounce:  # the write owns its bytes: record the page as on disk now so the node may leave host
            self.transfers.bounced.add(node.id)
            self.tree.set_location(node, DISK, list(node.keys))
        else:  # the host pages must outlive the write: pin them (the GPU copy may still be evicted)
            self.eviction.disk_inflight += n
            self.tree.pin(node)
        self.stats.moved(HOST, DISK, n, self.page_bytes)
        return None

    # ------------------------------------------------------------------ completions

    def _count_refused(self, c: Completion) -> None:
        """Count a write's refused pages by the store's reason (l3_write_failed where it gives none)."""
        reasons = c.reasons or (None,) * len(c.results)
        for ok, reason in zip(c.results, reasons):
            if not ok:
                self.stats.drops[WRITE_REFUSALS.get(reason or "", "l3_write_failed")] += 1

    def apply(self, c: Completion) -> None:
        """A write completed: record its pages as on disk (or count the failure)."""
        node: TreeNode = c.token
        self.transfers.writing.pop(node.id, None)
        if node.id in self.transfers.bounced:
            self.transfers.bounced.discard(node.id)
            if not all(c.results):  # recorded on disk at submit; undo, with what hangs below
                self._count_refused(c)
                if not node.removed:
                    self.transfers.mark_invalid(node)
            return
        self.eviction.disk_inflight -= len(c.results)
        self.tree.unpin(node)
        if not all(c.results):
            self._count_refused(c)
            return
        # the node may have been split since: its upper parts are ancestors holding keys of this write
        part: TreeNode | None = node
        while part is not None and not part.removed and not part.base and part.keys[0] in c.keys:
            if not part.on_disk:
                self.tree.set_location(part, DISK, list(part.keys))
            self._unwait(part)  # a part split off and queued again: written now
            part = part.parent
