"""Prefetch: reading a queued request's disk-only prefix into host memory while it waits.

A request that waits in the queue has time nobody else needs for its disk pages: `Prefetcher.prefetch` reads
them into host memory (deepest first where the cost model overlaps a computed head with a loaded tail) and pins
them in a `PrefetchHold` until the request is admitted, so that it loads them from host memory. The reads share
the host staging share with requests' own reads (`Loads.staged_pages`), and the disk's read queue is kept short
(`cache.load_policy.prefetch_queue_s`): a read still queued at admission is mostly computed instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from controller.loads import Loads
from controller.ticket import PrefetchHold
from controller.transfers import DiskLoad
from radix import DISK, HOST, MatchResult, RadixTree, TreeNode


class Prefetcher:
    """Prefetch holds for queued requests, over the Loads' reads and staging counts (see the module doc)."""

    def __init__(self, loads: Loads, tree: RadixTree, match: Callable[..., MatchResult],
                 backup: Callable[[Sequence[TreeNode]], None], room_version: Callable[[], int],
                 queue_s: float = 0.0):
        self.loads = loads
        self.tree = tree
        self.match = match  # the controller's match (with its L3 probe)
        self.backup = backup  # the write policies' copies of a prefix about to be used (Writes.hit)
        self.room_version = room_version  # the controller's count of events that gave host memory back
        self.queue_s = queue_s  # seconds of reads prefetch may keep queued (0: no bound)

    def prefetch(self, tokens: Sequence[int], max_pages: int | None, hold: PrefetchHold | None,
                 namespace: object) -> PrefetchHold:
        """TierController.prefetch. A `short` hold (no room) passed back as `hold` goes on where it stopped, once
        asking again could find more: something gave host memory back, or the disk's read queue has room.

        A hold that is not short, passed back, is a recheck: the request still waits, and pages of its prefix
        may have left memory since. Its match keeps the prefix recent but counts no hit (the request was counted
        when it first asked, and is again at admission; a queue's rechecks would otherwise make a page waited
        for look used many times, to LFU eviction and hit-counting write policies). The write policies' copies
        of a prefix about to be used still run; where every matched page is still in memory or already held,
        no read is planned."""
        loads = self.loads
        if not loads.prefetch_enabled:
            return hold or PrefetchHold()
        if hold is not None and hold.short and (
                not self.refill_ready() if hold.queue_bound
                else hold.room_version == self.room_version() or loads.staged_pages >= loads.staging_pages):
            return hold  # the disk's queue is still full, nothing gave host memory back since it stopped, or the
            # staging share is used up: asking again (a match of a long prompt, an allocation that fails) costs the
            # engine thread milliseconds a step for the same answer
        recheck = hold if hold is not None and not hold.short else None
        m = self.match(tokens, namespace, reference=recheck is None)
        # its prefix is about to be used again: back it up. Locked meanwhile: the room those copies make must come
        # from other pages, or an ancestor's last copy could go and take matched nodes out of the tree
        self.tree.lock(m.last_node)
        try:
            self.backup([node for node, _ in m.segments])
        finally:
            self.tree.unlock(m.last_node)
        if recheck is not None and not self.would_act(m, recheck):
            return recheck  # (a rechecking queue's front asked this about ten times a second and found nothing new)
        hold = self.read(m, max_pages, hold)
        hold.room_version = self.room_version()
        return hold

    def read(self, m: MatchResult, max_pages: int | None, hold: PrefetchHold | None) -> PrefetchHold:
        """Hold a queued request's cached prefix in host memory until it is admitted (TierController.prefetch).

        Only the pages a load would use once they are in host memory are read: the cost model's load-or-recompute
        decision with disk pages priced as host pages, since a read started now travels while the request
        queues. Load mode "never" reads nothing; "auto" reads what loading from host beats recomputing."""
        loads = self.loads
        retry = hold is not None
        if hold is None:
            hold = PrefetchHold()
        hold.short = hold.queue_bound = False
        held = {id(node) for node, _ in hold.pins}
        _, runs = loads.usable_runs(m)
        limit = loads.cost.pages_to_load([(HOST if tier == DISK else tier, n) for tier, n in runs])
        if max_pages is not None:
            limit = min(limit, max_pages)
        budget = loads.staging_pages - loads.staged_pages
        queue_room = self._queue_room()
        queue_bound = False  # the disk's read queue, not host room, stops it
        if queue_room is not None and queue_room < budget:
            budget, queue_bound = queue_room, True
        candidates: list[tuple[TreeNode, str]] = []
        pos = 0
        for node, tier in m.segments:
            if loads.transfers.unusable(node) or pos >= limit:
                break
            if node.on_device and not node.on_host and not node.on_disk:
                # a pin below it would hold its only copy on the GPU (pins count along the path, and a parent
                # outlives its children): queued requests must not fill the GPU pool with pages nobody can evict
                break
            pos += node.num_pages
            candidates.append((node, tier))
        if loads.cost.overlap:  # deepest first: what lands is the tail, and the request computes the cheap head
            candidates.reverse()
        self.tree.lock(m.last_node)  # host room is made from other pages than this prefix's
        started = 0
        try:
            for node, tier in candidates:
                if id(node) in held:
                    continue
                if not node.on_device and ((loads.transfers.prefetched(node) and node.on_host)
                                           or loads.transfers.disk_load(node) is not None):
                    self.tree.pin(node)  # brought in (or coming) for another queued request: hold it too
                    hold.pins.append((node, 0))
                    continue
                if tier != DISK or node.on_host:
                    continue
                chunks = loads.read_chunks(node)
                for chunk in reversed(chunks) if loads.cost.overlap else chunks:
                    n = chunk.num_pages
                    room = budget - started
                    if n > room and room > 0:  # read what fits, the deepest pages (or the first) of the chunk
                        upper = self.tree.split(chunk, n - room if loads.cost.overlap else room)
                        chunk = chunk if loads.cost.overlap else upper
                        n = chunk.num_pages
                        hold.short, hold.queue_bound = True, queue_bound  # the rest of it waits for room
                    elif n > room:
                        # short (worth asking again: once reads land, or holds are released) unless it could not fit
                        # even with every other hold released
                        own = sum(k for _, k in hold.pins)
                        hold.short = queue_bound or n <= loads.staging_pages - own
                        hold.queue_bound = queue_bound
                        break
                    # best effort: never block the engine thread for copies still landing in freed host pages
                    host_pages = loads.eviction.allocate(HOST, n, group=chunk.group, wait=False)
                    if host_pages is None:
                        if not retry:  # counted once per request, not once per step it asks again
                            loads.stats.drops["host_full_on_prefetch"] += n
                        hold.short = True
                        break
                    loads.start_read(chunk, DiskLoad(host_pages, to_device=False, prefetch=True, eta=loads.disk_eta(n)))
                    self.tree.pin(chunk)
                    loads.prefetching += n
                    started += n
                    hold.pins.append((chunk, n))
                    if hold.short:
                        break
                if hold.short:
                    break
        finally:
            self.tree.unlock(m.last_node)
        hold.started += started
        loads.stats.prefetched_pages += started
        return hold

    def would_act(self, m: MatchResult, hold: PrefetchHold) -> bool:
        """Whether `read(m, ..., hold)` may read or pin anything: a matched node the hold does not hold is only on
        disk, or on its way to host memory for another queued request (the nodes `read` acts on: kept alike)."""
        loads = self.loads
        held = {id(node) for node, _ in hold.pins}
        for node, _ in m.segments:
            if node.loc[0] is None and id(node) not in held and (
                    node.loc[1] is None or loads.transfers.disk_load(node) is not None
                    or loads.transfers.prefetched(node)):
                return True
        return False

    def refill_ready(self) -> bool:
        """Whether a prefetch the disk's read queue stopped should go on now: the queue has room for a refill of
        a quarter of it (at most a read chunk). Room for a page or two comes back with every read that lands, and
        asking again for it (a match of a long prompt, its path locked and unlocked) cost the engine thread
        milliseconds a step, for a queue that stays three quarters full either way."""
        loads = self.loads
        room = self._queue_room()
        if room is None:
            return True
        queue = self.queue_s * (loads.cost.disk_to_device_bytes_per_s or 0) / loads.page_bytes
        return room >= max(1, min(loads.read_chunk_pages, math.ceil(queue / 4)))

    def _queue_room(self) -> int | None:
        """Pages a prefetch may add to the disk's read queue now: what the disk reads in `prefetch_queue_s`, less the
        reads queued ahead of them by the estimate (`DiskReads.ahead`); None where unbounded or the bandwidth is
        unknown.

        The queue stays short because a request's reads still queued at its admission are, by then, mostly not
        worth waiting for: the plan computes those pages (the GPU reaches them first), and the disk time spent on
        them is lost to the next request's prefix. A read that lands frees room for the next (the scheduler asks
        again after each completion), so the disk still never idles while prefixes wait."""
        loads = self.loads
        bw = loads.cost.disk_to_device_bytes_per_s
        if not self.queue_s or not bw:
            return None
        return max(0, math.ceil((self.queue_s - loads.disk_reads.ahead()) * bw / loads.page_bytes))

    def release(self, hold: PrefetchHold) -> None:
        """Give back a prefetch hold (the request was admitted, or left the queue)."""
        loads = self.loads
        for node, n in hold.pins:
            self.tree.unpin(node)
            loads.prefetching -= n
            load = loads.transfers.disk_load(node)
            if n and load is not None and load.held:  # still in flight: it counts as a read only from now on
                load.held = False
                loads.held_reading -= len(load.host_pages)
        hold.pins = []
