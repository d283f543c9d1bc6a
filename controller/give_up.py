"""Disk reads a request stops waiting for: what they would cost to recompute, when they should land, and the cut
of its ticket before them. The scheduler's deadlines use these (hicache/engine/scheduler.py, `_wait_for_loads`):
a request waits for its reads no longer than the GPU would take to reach it and recompute them."""

from __future__ import annotations

from collections.abc import Callable

from controller.cost import CostModel
from controller.ports import Pool
from controller.stats import REMOTE, CacheStats
from controller.ticket import LoadTicket
from controller.transfers import Transfers
from radix import DEVICE, RadixTree


class ReadDeadlines:
    """Reads a ticket waits for, and giving them up. `cost` and `clock` are the loads' own (the cost model's disk
    bandwidth follows measured reads; tests replace the clock)."""

    def __init__(self, tree: RadixTree, device: Pool, transfers: Transfers, stats: CacheStats,
                 cost: Callable[[], CostModel], clock: Callable[[], float]):
        self.tree = tree
        self.device = device
        self.transfers = transfers
        self.stats = stats
        self.cost = cost
        self.clock = clock
        self.page_size = tree.page_size

    def pending_reads(self, ticket: LoadTicket) -> tuple[float, float]:
        """What the ticket still waits for from disk, the pages from its first node whose disk read is in flight
        to the end of its prefix: (seconds the GPU would take to recompute them, seconds until the last of those
        reads should land by the disk queue's estimate). (inf, 0) where it waits for no read, or the prefill speed
        is unknown."""
        cut = self._first_reading(ticket)
        if cut is None:
            return float("inf"), 0.0
        nodes = ticket.nodes
        start = sum(n.num_pages for n in nodes[:cut])
        etas = [load.eta for n in nodes[cut:] if (load := self.transfers.disk_load(n)) is not None]
        return self.cost().compute_seconds(start, ticket.num_pages), max(etas) - self.clock()

    def _first_reading(self, ticket: LoadTicket) -> int | None:
        """Index in ticket.nodes of the first node (before its gap, if any) whose disk read has not landed."""
        for i, node in enumerate(ticket.prefix_nodes):
            if self.transfers.disk_load(node) is not None:
                return i
        return None

    def give_up_reads(self, ticket: LoadTicket) -> LoadTicket | None:
        """Stop waiting for the ticket's disk reads that have not landed: the ticket ends before the first node
        still reading, and its holder computes the rest. The reads go on and land in host memory as prefetched
        pages (a later request finds them there); the GPU pages they were to fill are freed now, nothing having
        been copied into them yet. Returns a ticket holding the old lock, to release once the transfers under it
        settle (copies into GPU pages further on may still be landing); None where there is nothing to give up,
        or another request waits for the same reads (they stay its load)."""
        cut = self._first_reading(ticket)
        if cut is None:
            return None
        nodes = ticket.nodes
        rest = nodes[cut:]
        # another request's ticket on the same pages waits for them: for the read into its GPU pages, or for the copy
        # of a prefetched read into them once it lands in host memory (GPU pages assigned, the read itself to host)
        if any(node.lock_ref > 1 and (load := self.transfers.disk_load(node)) is not None
               and (load.to_device or node.on_device) for node in rest):
            return None
        for node in rest:
            load = self.transfers.disk_load(node)
            if load is None:
                continue
            if load.to_device:
                load.to_device = False
                load.prefetch = True  # lands as a host copy read from disk: a later hit on it counts as a disk hit
            if node.on_device:
                self.device.free(self.tree.unassign(node, DEVICE))
        start = sum(n.num_pages for n in nodes[:cut])
        self._take_back_hits(ticket, start)
        self.stats.gave_up_reads += 1
        residual = LoadTicket(self.transfers, ticket.node, 0)
        ticket.node = nodes[cut - 1] if cut else ticket.base
        ticket.gap = None
        self.tree.lock(ticket.node)  # the residual keeps the old lock
        return residual

    def _take_back_hits(self, ticket: LoadTicket, start: int) -> None:
        """Pages from `start` on are computed now, not hits: take them out of the ticket's and the stats' counts."""
        kept: list[tuple[int, int, str]] = []
        for a, b, tier in ticket.hit_runs:
            if b > start:
                gone = b - max(a, start)
                local = min(gone, ticket.hit_pages.get(tier, 0))
                self._uncount(ticket, tier, local)
                self._uncount(ticket, REMOTE, gone - local)  # disk pages that were the remote tier's (acquire)
                self.stats.recomputed[tier] += local * self.page_size
                self.stats.recomputed[REMOTE] += (gone - local) * self.page_size
            if a < start:
                kept.append((a, min(b, start), tier))
        ticket.hit_runs = kept

    def _uncount(self, ticket: LoadTicket, tier: str, pages: int) -> None:
        if pages <= 0:
            return
        ticket.hit_pages[tier] -= pages
        if not ticket.hit_pages[tier]:
            del ticket.hit_pages[tier]
        self.stats.hit_tokens[tier] -= pages * self.page_size
