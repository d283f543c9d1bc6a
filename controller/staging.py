"""Staging: copying a queued request's host-resident prefix onto the GPU before it is admitted.

A request that cannot be admitted yet waits for GPU pages: those of the running requests come back only when they
finish. Its prefix then loads after they do, while the GPU waits for the copy (a long agent prompt's prefix is
gigabytes: on the H100's PCIe link, longer than its own prefill). The GPU pages that no running request holds
are free meanwhile, or hold cached pages that the request's admission would evict anyway. `Staging.stage` copies
the first pages of the prefix into them (at most a budget the scheduler gives: what running requests and the
queue ahead of it do not need) and locks them in a `LoadTicket` until admission. There the prefix is found on the
GPU (its copies still landing, perhaps: the forward waits for them layer by layer), and only the rest loads.

Staged pages stay host (or, prefetched from L3, disk) hits for the request served from them: `Transfers.staged`
marks them until a ticket uses them. The copies are host -> GPU only: a prefix still on disk is prefetch's
(controller/prefetch.py), and stages once it has landed in host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.loads import Loads
from controller.stats import CacheStats
from controller.ticket import LoadTicket
from controller.transfers import PENDING_COPY, PREFETCHED
from radix import DEVICE, DISK, HOST, CacheNamespace, MatchResult, RadixTree, TreeNode


class Staging:
    """Stages queued requests' prefixes on the GPU, over the Loads' copier and eviction (see the module doc).
    `enabled`: cache.load_policy.stage, with a host tier and a load mode that loads."""

    def __init__(self, loads: Loads, tree: RadixTree, match: Callable[..., MatchResult], stats: CacheStats,
                 enabled: bool = True):
        self.loads = loads
        self.tree = tree
        self.match = match  # the controller's match (with its L3 probe)
        self.stats = stats
        self.enabled = enabled and loads.host.capacity_pages > 0 and loads.cost.mode != "never"

    def stage(self, tokens: Sequence[int], max_pages: int, budget: int,
              namespace: CacheNamespace) -> tuple[LoadTicket, int] | None:
        """Lock the first pages of the cached prefix of `tokens` on the GPU, copying those only in host memory
        there; returns the ticket that holds them and how many GPU pages it locks (at most `budget`, counting the
        pages that were on the GPU already), or None where there is nothing to copy: the prefix is on the GPU or
        not in memory, its next pages are still being read, loading them would not beat computing them, or no GPU
        room is left. The match counts no hit (the request is counted at admission).

        The pages staged are those a load at admission would take from host memory: the cost model's choice for
        a busy GPU (the request waits behind running ones), within max_pages."""
        m = self.match(tokens, namespace, reference=False)
        loads = self.loads
        usable, runs = loads.usable_runs(m)
        limit = min(max_pages, budget, loads.cost.pages_to_load(runs, busy=True))
        nodes: list[TreeNode] = []
        pos = 0
        for node in usable:
            if pos >= limit:
                break
            if not node.on_device and (not node.on_host or loads.transfers.get(node) not in (None, PREFETCHED)):
                break  # on disk only, or a read in flight: prefetch and admission see to those
            if pos + node.num_pages > limit:
                node = self.tree.split(node, limit - pos)  # the upper part: the first pages
            nodes.append(node)
            pos += node.num_pages
        copies = [node for node in nodes if not node.on_device]
        if not copies:
            return None
        ticket = LoadTicket(loads.transfers, nodes[-1], m.num_pages)
        self.tree.lock(ticket.node)  # before allocating: the room is made from other pages than this prefix's
        want = sum(node.num_pages for node in copies)
        pages = loads.eviction.allocate(DEVICE, want)
        if pages is None:
            self.tree.unlock(ticket.node)
            return None
        for node in copies:
            n = node.num_pages
            # where the bytes came from, for the hit that uses them: L3 for a prefetched host copy
            loads.transfers.staged[node] = DISK if loads.transfers.prefetched(node) else HOST
            self.tree.set_location(node, DEVICE, pages[:n])
            del pages[:n]
            loads.transfers.set(node, PENDING_COPY)
        loads.start_copies(copies)
        self.stats.moved(HOST, DEVICE, want, loads.page_bytes)
        self.stats.staged_pages += want
        return ticket, pos
