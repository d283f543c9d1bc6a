"""Loads: how much of a matched prefix to use, and bringing it onto the GPU.

`acquire` prices the matched prefix with the cost model (load or recompute, and with overlap a gap
to compute while the rest loads), locks what it uses in a LoadTicket and starts the copies: host ->
GPU through the copier (one call per prefix), L3 -> host -> GPU through the L3 worker. It keeps the
counts of host pages disk reads hold, which prefetch (controller/prefetch.py) shares. `apply` lands a
finished read.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

from controller.cost import CostModel, LoadPlan, clip_runs
from controller.disk_reads import DiskReads
from controller.eviction import Eviction
from controller.give_up import ReadDeadlines
from controller.ports import Copier, HostTier, Pool, Worker, page_buffers
from controller.stats import REMOTE, CacheStats
from controller.ticket import LoadTicket
from controller.transfers import FAILED, PENDING_COPY, PREFETCHED, DiskLoad, Transfers
from radix import DEVICE, DISK, HOST, MatchResult, RadixTree, TreeNode
from tiers.l3.worker import Completion

# a disk read is at most this many bytes: a long prefix lands in parts (0.13 s each at 2 GB/s), so a request that
# stops waiting at its deadline (controller/give_up.py) keeps the parts that landed
READ_CHUNK_BYTES = 256 << 20


class Loads:
    """Load planning, copies to the GPU, tickets and disk reads (see the module doc)."""

    def __init__(self, tree: RadixTree, device: Pool, host: HostTier, copier: Copier, worker: Worker,
                 eviction: Eviction, transfers: Transfers, stats: CacheStats, cost: CostModel, prefetch: bool,
                 shared_pages: Callable[[Sequence[bytes]], int] | None = None, staging_share: float = 0.5):
        self.tree = tree
        self.shared_pages = shared_pages  # how many of these disk keys only the remote tier holds (REMOTE hits)
        self.device = device
        self.host = host
        self.copier = copier
        self.worker = worker
        self.eviction = eviction
        self.transfers = transfers
        self.stats = stats
        self.cost = cost
        self.page_size = tree.page_size
        self.page_bytes = device.page_bytes
        self.prefetch_enabled = prefetch and cost.mode != "never"  # the caller says whether there is a disk tier
        self.prefetching = 0  # pages read by prefetch holds not yet released
        self.request_reads = 0  # host pages that reads started by tickets are filling
        self.reading = 0  # host pages that reads in flight are filling, whoever started them
        self.held_reading = 0  # of those, pages still held by the hold that started the read (in both counts)
        self.read_chunk_pages = max(1, READ_CHUNK_BYTES // max(1, self.page_bytes))
        self.clock = time.monotonic  # read landing estimates (replaceable in tests, with the scheduler's)
        # the reads a ticket waits for, and giving them up at the scheduler's deadline
        self.deadlines = ReadDeadlines(tree, device, transfers, stats, lambda: self.cost, lambda: self.clock())
        # host pages for disk traffic (cache.load_policy.prefetch_host_share), so that GPU -> host copies of new
        # pages always find room: a prefetch starts only while reads in flight and prefetched pages held stay
        # within it, and a request's reads only while other requests' reads do (a lone request always reads)
        self.staging_pages = int(staging_share * host.capacity_pages)
        self.disk_reads = DiskReads(lambda: self.clock())  # the read queue's landing and bandwidth estimates

    # ------------------------------------------------------------------ planning

    def usable_runs(self, m: MatchResult) -> tuple[list[TreeNode], list[tuple[str, int]]]:
        """The usable matched nodes and their (tier to load from, pages) runs. A read in flight (a prefetch)
        counts as host if it should land before the GPU could recompute its own pages, else as a disk read:
        waiting for it longer than that loses time whatever follows it."""
        runs: list[tuple[str, int]] = []
        usable: list[TreeNode] = []
        now, pages = self.clock(), 0
        for node, tier in m.segments:
            if self.transfers.unusable(node):
                break
            pages += node.num_pages
            load = self.transfers.disk_load(node)
            if load is not None and not node.on_host:
                own = self.cost.compute_seconds(pages - node.num_pages, pages)
                tier = HOST if load.eta - now <= own else DISK
            usable.append(node)
            runs.append((tier, node.num_pages))
        return usable, runs

    def acquire(self, m: MatchResult, max_pages: int | None, overlap: bool, busy: bool = False) -> LoadTicket:
        """Decide how much of the match to use, lock it and start its loads (see TierController.acquire)."""
        usable, runs = self.usable_runs(m)
        total = sum(n for _, n in runs)
        if overlap and self.cost.overlap:
            cap = total if max_pages is None else min(total, max_pages)
            plan = self.cost.plan(clip_runs(runs, cap), busy)
            self._count_recomputed(runs, plan.k, plan.s)
            self._count_recomputed(runs, plan.n, cap)
        else:
            want = self.cost.pages_to_load(runs, busy)
            self._count_recomputed(runs, want, total)
            if max_pages is not None:
                want = min(want, max_pages)
            plan = LoadPlan(want, want, want)
        k, s, ps = plan.k, plan.s, self.page_size
        nodes = self._split_at(self._split_at(self._cut(usable, plan.n), k), s)
        nodes = [part for node in nodes for part in (self.read_chunks(node) if self._reads_from_disk(node) else [node])]
        # where the bytes come from: prefetched pages count as disk hits, staged ones (controller/staging.py) as the
        # tier they were copied from
        staged = self.transfers.staged
        tiers = [staged.get(n, DEVICE) if n.on_device else HOST if n.on_host and not self.transfers.prefetched(n)
                 else DISK for n in nodes]
        base = m.base if m.base is not None else self.tree.root
        ticket = LoadTicket(self.transfers, nodes[-1] if nodes else base, m.num_pages,
                            gap=(k, s) if k < s else None)
        self.tree.lock(ticket.node)
        # each node's pages and keys as they are now: the room a load makes in host memory may evict the host copy
        # of one of these nodes that is on the GPU (radix.tree), splitting it there; the object kept is the lower
        # part, so positions counted from the nodes' sizes later would slip, and tail nodes would pass for gap nodes
        sizes = [node.num_pages for node in nodes]
        keys = [node.keys for node in nodes]
        starts = list(itertools.accumulate(sizes, initial=0))
        copies: list[TreeNode] = []
        others_reading = self.request_reads > 0  # a ticket alone with its reads always reads
        spare = self._allocate_loads(nodes, k, s)
        for i, node in enumerate(nodes):
            pos = starts[i]
            if not k <= pos < s and not node.on_device and not self._load_node(node, copies, spare,
                                                                                others_reading):
                if pos <= s:  # no room in the prefix, or for any of the tail: no gap either
                    ticket.gap = None
                    i = min(i, bisect.bisect_left(starts, k, hi=len(nodes)))  # the nodes before the gap
                self._truncate(ticket, nodes[i - 1] if i else base)
                nodes = nodes[:i]
                break
        if spare:
            self.device.free(spare)  # a load stopped early (no host room for a disk read): its pages go back
        self.start_copies(copies)
        disk_keys: list[bytes] = []
        for i, tier in enumerate(tiers[: len(nodes)]):
            pos, end = starts[i], starts[i + 1]
            if not k <= pos < s or ticket.gap is None:  # the gap's pages are computed, not hits
                ticket.hit_pages[tier] = ticket.hit_pages.get(tier, 0) + end - pos
                ticket.hit_runs.append((pos, end, tier))
                if tier == DISK:
                    disk_keys += keys[i]  # a page's disk key (a prefetched copy's disk entry may be gone since)
        if disk_keys and self.shared_pages is not None and (shared := self.shared_pages(disk_keys)):
            ticket.hit_pages[REMOTE] = shared  # disk pages this server's local store lacks: the remote tier's
            ticket.hit_pages[DISK] -= shared
            if not ticket.hit_pages[DISK]:
                del ticket.hit_pages[DISK]
        for tier, pages in ticket.hit_pages.items():
            self.stats.hit_tokens[tier] += pages * ps
        if staged:
            for node in ticket.nodes:  # served: later hits on these pages are GPU hits
                staged.pop(node, None)
        return ticket

    def _count_recomputed(self, runs: list[tuple[str, int]], start: int, end: int) -> None:
        """Matched pages [start, end) are computed, not loaded: counted by the tier they were in."""
        pos = 0
        for tier, n in runs:
            if pos >= end:
                break
            overlap = min(end, pos + n) - max(start, pos)
            if overlap > 0:
                self.stats.recomputed[tier] += overlap * self.page_size
            pos += n

    def read_chunks(self, node: TreeNode) -> list[TreeNode]:
        """The node split into parts of at most `read_chunk_pages`, top-down: each is read as one call, so a long
        prefix lands part by part and a request that stops waiting keeps what has landed."""
        parts = []
        while node.num_pages > self.read_chunk_pages:
            parts.append(self.tree.split(node, self.read_chunk_pages))  # the upper part: the first pages
        parts.append(node)
        return parts

    def _reads_from_disk(self, node: TreeNode) -> bool:
        """Whether loading the node starts a disk read (only on disk, no read in flight)."""
        return not node.on_device and not node.on_host and self.transfers.disk_load(node) is None

    def _cut(self, nodes: list[TreeNode], pages: int) -> list[TreeNode]:
        """The leading nodes covering exactly `pages` pages (splitting the last one if needed)."""
        out: list[TreeNode] = []
        used = 0
        for node in nodes:
            if used >= pages:
                break
            if used + node.num_pages > pages:
                node = self.tree.split(node, pages - used)
            out.append(node)
            used += node.num_pages
        return out

    def _split_at(self, nodes: list[TreeNode], page: int) -> list[TreeNode]:
        """The path `nodes` with a node boundary at `page` (splitting the node that straddles it)."""
        out: list[TreeNode] = []
        pos = 0
        for node in nodes:
            if pos < page < pos + node.num_pages:
                out.append(self.tree.split(node, page - pos))  # the upper part; `node` keeps the rest
            out.append(node)
            pos += node.num_pages
        return out

    def _truncate(self, ticket: LoadTicket, node: TreeNode) -> None:
        """Shorten the ticket's prefix to end at `node` (an ancestor), moving its lock."""
        old = ticket.node
        ticket.node = node
        self.tree.lock(node)
        self.tree.unlock(old)

    # ------------------------------------------------------------------ copies

    def _allocate_loads(self, nodes: list[TreeNode], k: int, s: int) -> list[int]:
        """GPU pages for every node of a new ticket that must be loaded (outside its gap [k, s)), taken in one
        allocation, or [] if they do not all fit (each node then allocates its own, and the ticket stops at the
        first that cannot). One allocation evicts in one pass: per node, eviction split other nodes into
        ever smaller pieces, and a long prefix paid an eviction call per piece."""
        want, pos = 0, 0
        for node in nodes:
            if not k <= pos < s and not node.on_device:
                want += node.num_pages
            pos += node.num_pages
        if want <= 1:
            return []
        return self.eviction.allocate(DEVICE, want) or []

    def _load_node(self, node: TreeNode, copies: list[TreeNode], spare: list[int], others_reading: bool) -> bool:
        """Give a locked node GPU pages and start bringing its data there; False (counted) if no room.

        Nodes to copy from host are appended to `copies` for `start_copies` (one copier call per prefix).
        The GPU pages come from the front of `spare` (taken from it) while it has enough, else are allocated. A disk
        read is refused past the staging share only when `others_reading` (other tickets' reads are in flight).
        """
        n = node.num_pages
        if not node.on_host and node.id in self.transfers.writing:
            return False  # a write-back's bytes are on their way to disk: not readable yet
        prefetch = self.transfers.disk_load(node)
        if prefetch is None:
            self.transfers.clear(node)  # any earlier transfer finished with the device copy it filled
        dev: list[int] | None
        if len(spare) >= n:
            dev = spare[:n]
            del spare[:n]
        else:
            dev = self.eviction.allocate(DEVICE, n)
        if dev is None:
            self.stats.drops["device_full_on_load"] += n
            return False
        if prefetch is not None:  # its read is in flight: it lands in host memory, then copies here
            prefetch.to_device = True
        elif node.on_host:
            copies.append(node)
            self.transfers.set(node, PENDING_COPY)  # its host copy must outlive the allocations of the nodes after it
            self.stats.moved(HOST, DEVICE, n, self.page_bytes)
        else:
            if others_reading and self.request_reads + n > self.staging_pages:
                self.device.free(dev)  # other requests' reads hold the staging share: compute these pages instead
                self.stats.drops["host_staging_full_on_load"] += n
                return False
            host_pages = self.eviction.allocate(HOST, n)
            if host_pages is None:
                self.device.free(dev)
                self.stats.drops["host_full_on_load"] += n
                return False
            self.start_read(node, DiskLoad(host_pages, eta=self.disk_eta(n)))
        self.tree.set_location(node, DEVICE, dev)
        return True

    @property
    def staged_pages(self) -> int:
        """Host pages disk traffic holds: reads in flight, and prefetched pages that holds keep."""
        return self.reading + self.prefetching - self.held_reading

    def start_read(self, node: TreeNode, load: DiskLoad) -> None:
        n = len(load.host_pages)
        self.reading += n
        if load.for_request:
            self.request_reads += n
        else:
            self.held_reading += n  # held by the prefetch hold that starts it (Prefetcher.read)
            load.held = True
        self.transfers.set(node, load)
        self.transfers.loading[node.id] = node
        self.worker.submit_read(node, node.disk_keys, page_buffers(self.host, load.host_pages))

    def start_copies(self, nodes: list[TreeNode]) -> None:
        """Copy these nodes' host pages into their (just assigned) GPU pages in one copier call, one transfer
        for all: per-call costs (index uploads, stream waits, Python) are paid once per prefix, not per node."""
        if not nodes:
            return
        asked = {id(n) for n in nodes}
        pending = lambda p: id(p) not in asked and self.transfers.get(p) is PENDING_COPY  # noqa: E731
        nodes = [part for node in nodes for part in self._pieces(node, pending)]  # with any parts split off above
        transfer = self.copier.to_device([p for n in nodes for p in n.host_pages],
                                         [p for n in nodes for p in n.device_pages])
        for node in nodes:
            self.transfers.set(node, transfer)

    def disk_eta(self, pages: int) -> float:
        """When a read of `pages` submitted now should land: reads queue behind each other on the disk."""
        return self.disk_reads.eta(pages * self.page_bytes, self.cost.disk_to_device_bytes_per_s)

    # ------------------------------------------------------------------ completions

    def apply(self, c: Completion) -> None:
        """A read completed: its pages are in host memory now (and copy on to the GPU for a request), or, if it
        failed verification, its nodes are marked failed and removed once nobody holds them."""
        node: TreeNode = c.token
        self.transfers.loading.pop(node.id, None)
        if node.removed:  # it left the tree while the read was in flight: its host pages are done with now
            load = self.transfers.orphan_reads.pop(node.id)
            self._count_read_done(load)
            self.host.free(load.host_pages)
            return
        load = self.transfers.reading(node)
        self._count_read_done(load)
        parts = self._pieces(node, lambda p: self.transfers.get(p) is load)  # the node may have been split
        n = len(c.results)
        if all(c.results):
            offset = 0
            for part in parts:
                host_pages = load.host_pages[offset : offset + part.num_pages]
                offset += part.num_pages
                self.tree.set_location(part, HOST, host_pages)
                if load.to_device and part.on_device:
                    self.transfers.set(part, self.copier.to_device(host_pages, part.device_pages))
                    self.stats.moved(HOST, DEVICE, part.num_pages, self.page_bytes)
                elif load.prefetch:
                    self.transfers.set(part, PREFETCHED)
                else:
                    self.transfers.clear(part)
            self.stats.moved(DISK, HOST, n, self.page_bytes)
            if not c.shared:  # a write batch ran beside it: its time is the two sharing the disk
                self._observe_disk_read(n * self.page_bytes, c.seconds, c.end or time.monotonic())
        else:
            self.host.free(load.host_pages)
            self.stats.load_failures += 1
            for part in parts:
                self.transfers.set(part, FAILED)
                self.transfers.mark_invalid(part)

    def _count_read_done(self, load: DiskLoad) -> None:
        """A read is no longer in flight: out of the staging counts."""
        self.reading -= len(load.host_pages)
        if load.for_request:
            self.request_reads -= len(load.host_pages)
        if load.held:
            load.held = False
            self.held_reading -= len(load.host_pages)

    @staticmethod
    def _pieces(node: TreeNode, belongs: Callable[[TreeNode], bool]) -> list[TreeNode]:
        """node and the ancestors split off it that still belong to the same transfer, top-down."""
        parts = [node]
        while (up := parts[0].parent) is not None and not up.base and belongs(up):
            parts.insert(0, up)
        return parts

    def _observe_disk_read(self, nbytes: int, seconds: float, end: float) -> None:
        """Fold a measured L3 read into the cost model's disk bandwidth, so decisions follow the disk
        (`DiskReads.observe`); a configured bandwidth stays.

        Only reads that had the disk to themselves count. One that a write batch ran beside took longer by the
        write's share of the disk: counted, the estimate fell to the read speed left over by the writes of that
        moment, and with it the reads the plan and prefetch start, while the writer yields to reads anyway
        (tiers/l3/worker.py). bench/RESULTS.md, 'The disk adds its bandwidth', has what that estimate cost."""
        if seconds <= 0 or not self.cost.adaptive:
            return
        bw = self.disk_reads.observe(nbytes, seconds, end, self.cost.disk_to_device_bytes_per_s)
        if bw is not None:
            self.cost = dataclasses.replace(self.cost, disk_to_device_bytes_per_s=bw)

    def loading_host_pages(self) -> Sequence[int]:
        """Host pages that reads in flight are filling (owned by nobody in the tree yet)."""
        t = self.transfers
        return [p for node in t.loading.values()
                for p in (t.orphan_reads[node.id] if node.removed else t.reading(node)).host_pages]
