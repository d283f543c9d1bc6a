"""The tier controller: decides when pages move between GPU, host and L3, and moves them.

It owns the eviction loop (LRU leaves first, per tier), the write policies (GPU -> host and
host -> L3: write_through, write_through_selective, write_back), promotion on prefix hits, the
L3 probe that finds pages written before a restart, and the load-or-recompute decision.

Threading: every method runs on one thread (the scheduler's). Copies are asynchronous through
TransferHandles, L3 I/O through an L3Worker; `poll()` applies finished I/O to the tree.

A request's life here: `acquire(tokens)` matches, plans and starts loads and returns a ticket
holding a lock; `ticket.ready()` says when its cached pages are usable; the caller computes the
rest into pages from `alloc_device`; `commit(ticket, tokens, pages)` inserts them (write
policies fire); `release(ticket)` drops the lock; `free_device` returns private pages.

With `acquire(..., overlap=True)` the ticket may have a gap: pages [k, s) of the prefix are left for
the caller to compute while [s, n) load; `commit_gap` adopts the computed pages, after which the
ticket is an ordinary one (see LoadTicket).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from controller.cost import CostModel, LoadPlan
from controller.l3_io import L3Worker
from controller.policy import WritePolicy
from controller.stats import CacheStats
from controller.ticket import FAILED, PREFETCHED, DiskLoad, LoadTicket, PrefetchHold
from radix import DEVICE, DISK, HOST, RadixTree, TreeNode, page_keys
from tiers.copy import COMPLETED, TransferHandle

logger = logging.getLogger(__name__)

# A deferred write-through backlog starts at most about this many bytes per engine step (`begin_step`). Starting
# a whole backlog at once (24 GB after a 32k-token burst on the H200) queued thousands of copy operations: the
# engine thread then blocked in CUDA launches until the copy engines drained. 1 GiB is ~20 ms of PCIe 5 copying.
FLUSH_SLICE_BYTES = 1 << 30


def _clip(runs: list[tuple[str, int]], pages: int) -> list[tuple[str, int]]:
    """The (tier, pages) runs cut down to their first `pages` pages."""
    out = []
    for tier, n in runs:
        if pages <= 0:
            break
        out.append((tier, min(n, pages)))
        pages -= n
    return out


class TierController:
    """Moves pages between a GPU pool, an optional host pool and an optional L3 store; see module doc."""

    def __init__(
        self,
        tree: RadixTree,
        device: Any,
        host: Any | None = None,
        l3: Any | None = None,
        copier: Any | None = None,
        write_policy: WritePolicy | None = None,
        cost: CostModel | None = None,
        l3_worker: L3Worker | None = None,
        disk_capacity_pages: int | None = None,
        prefetch: bool = True,
    ):
        if l3 is not None and host is None:
            raise ValueError("the disk tier needs a host tier: pages reach L3 through host memory")
        self.tree = tree
        self.device = device
        self.host = host
        self.l3 = l3
        self.copier = copier
        self.policy = write_policy or WritePolicy()
        self.page_size = tree.page_size
        self.page_bytes = device.page_bytes
        self.cost = cost or CostModel(tree.page_size, device.page_bytes)
        self.worker = l3_worker if l3_worker is not None or l3 is None else L3Worker(l3)
        self.disk_capacity = disk_capacity_pages if disk_capacity_pages is not None else (
            l3.capacity_pages if l3 is not None else 0
        )
        self.stats = CacheStats()
        self._private: set[int] = set()  # device pages handed to callers, not yet in the tree
        self._loading: dict[int, TreeNode] = {}  # node id -> node with an L3 read in flight
        self._writing: dict[int, TreeNode] = {}  # node id -> node pinned for an L3 write in flight
        self._disk_inflight = 0  # pages queued for L3 writes (counted against disk capacity)
        self._invalid: dict[int, TreeNode] = {}  # nodes whose load failed, removed once unlocked
        self._bounced: set[int] = set()  # node ids whose L3 write carries its own copy of the bytes
        self.prefetch_enabled = prefetch and l3 is not None
        self._prefetching = 0  # pages read by prefetch holds not yet released
        self._backups: dict[int, TransferHandle] = {}  # GPU page -> its latest GPU -> host copy (may be in flight)
        self._deferred: deque[TreeNode] = deque()  # committed nodes whose write-through copy waits (oldest first)
        self.flush_slice_pages = max(1, FLUSH_SLICE_BYTES // max(1, self.page_bytes))  # see FLUSH_SLICE_BYTES
        self._flush_budget = self.flush_slice_pages  # backlog pages this step may still start (begin_step renews)
        self._disk_read_free_at = 0.0  # when the L3 read queue drains, as the cost model sees it

    # ------------------------------------------------------------------ matching and loading

    def match(self, tokens: Sequence[int]) -> Any:
        """Longest cached prefix of tokens, extended by an L3 index probe past the in-memory tree."""
        m = self.tree.match_prefix(tokens)
        if self.l3 is not None:
            full = len(tokens) // self.page_size
            if m.num_pages < full and self._probe(tokens, m.last_node, m.num_pages, full):
                m = self.tree.match_prefix(tokens, touch=False)
        return m

    def _probe(self, tokens: Sequence[int], node: TreeNode, start: int, end: int) -> int:
        """Probe L3 for pages [start, end) of tokens (chained from node); attach the leading hits."""
        ps = self.page_size
        keys: list[bytes] = []
        found, batch = 0, 1
        while found < end - start:  # a miss ends the chain, so probe (and hash) in growing batches
            prev = keys[-1] if keys else self.tree.last_key(node)
            # pages [start + found, start + found + batch) of tokens
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

    def acquire(self, tokens: Sequence[int], max_pages: int | None = None, overlap: bool = False) -> LoadTicket:
        """Match tokens, decide how much of the cached prefix to use, lock it and start its loads.

        At most max_pages pages are used (callers keep at least one token to compute). Pages worth
        loading that are not on the GPU get GPU pages and copies; pages dearer to load than to
        recompute are left for the caller to compute. With `overlap` (a caller that handles gaps) and
        a cost model that allows it, the ticket may have a gap [k, s): those nodes are locked but not
        loaded; the caller computes them while [s, n) loads (see LoadTicket and commit_gap).
        """
        ps = self.page_size
        self.poll()
        m = self.match(tokens)
        self.stats.prompt_tokens += len(tokens)
        runs: list[tuple[str, int]] = []
        usable: list[TreeNode] = []
        now, pages = time.monotonic(), 0
        for node, tier in m.segments:
            if node.pending is FAILED or node.id in self._invalid:
                break
            pages += node.num_pages
            if isinstance(node.pending, DiskLoad) and node.loc[1] is None:
                # a read in flight (a prefetch): as good as host if waiting for it beats recomputing
                # the prefix up to here; otherwise priced as a disk read
                wait = node.pending.eta - now
                tier = HOST if wait <= pages * self.cost.compute_seconds() else DISK
            usable.append(node)
            runs.append((tier, node.num_pages))
        total = sum(n for _, n in runs)
        if overlap and self.cost.overlap:
            cap = total if max_pages is None else min(total, max_pages)
            plan = self.cost.plan(_clip(runs, cap))
            self.stats.recomputed_tokens += (plan.s - plan.k + cap - plan.n) * ps
        else:
            want = self.cost.pages_to_load(runs)
            self.stats.recomputed_tokens += (total - want) * ps
            if max_pages is not None:
                want = min(want, max_pages)
            plan = LoadPlan(want, want, want)
        k, s = plan.k, plan.s
        nodes = self._split_at(self._split_at(self._cut(usable, plan.n), k), s)
        tiers = [DEVICE if n.loc[0] is not None else HOST if n.loc[1] is not None and n.pending is not PREFETCHED
                 else DISK for n in nodes]  # where the bytes come from: prefetched pages count as disk hits
        ticket = LoadTicket(nodes[-1] if nodes else self.tree.root, m.num_pages, gap=(k, s) if k < s else None)
        self.tree.lock(ticket.node)
        pos = 0
        copies: list[TreeNode] = []
        spare = self._allocate_loads(nodes, k, s)
        for i, node in enumerate(nodes):
            if not k <= pos < s and node.loc[0] is None and not self._load_node(node, copies, spare):
                if pos <= s:  # no room in the prefix, or for any of the tail: no gap either
                    ticket.gap = None
                    i = min(i, len(ticket.part(0, k)))
                self._truncate(ticket, nodes[i - 1] if i else self.tree.root)
                nodes = nodes[:i]
                break
            pos += node.num_pages
        if spare:
            self.device.free(spare)  # a load stopped early (no host room for a disk read): its pages go back
        self._start_copies(copies)
        pos = 0
        for node, tier in zip(nodes, tiers):
            if not k <= pos < s or ticket.gap is None:  # the gap's pages are computed, not hits
                ticket.hit_pages[tier] = ticket.hit_pages.get(tier, 0) + node.num_pages
            pos += node.num_pages
        for tier, pages in ticket.hit_pages.items():
            self.stats.hit_tokens[tier] += pages * ps
        self._selective_backups(ticket.nodes)
        return ticket

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

    def _allocate_loads(self, nodes: list[TreeNode], k: int, s: int) -> list[int]:
        """GPU pages for every node of a new ticket that must be loaded (outside its gap [k, s)), taken in one
        allocation, or [] if they do not all fit (each node then allocates its own, and the ticket stops at the
        first that cannot). One allocation evicts in one pass: per node, eviction split other nodes into
        ever smaller pieces, and a long prefix paid an eviction call per piece."""
        want, pos = 0, 0
        for node in nodes:
            if not k <= pos < s and node.loc[0] is None:
                want += node.num_pages
            pos += node.num_pages
        if want <= 1:
            return []
        return self._allocate(DEVICE, want) or []

    def _load_node(self, node: TreeNode, copies: list[TreeNode], spare: list[int] | None = None) -> bool:
        """Give a locked node GPU pages and start copying its data there; False if no room.

        Nodes to copy from host are appended to `copies` for `_start_copies` (one copier call per prefix).
        The GPU pages come from the front of `spare` (taken from it) while it has enough, else are allocated.
        """
        n = node.num_pages
        if node.loc[1] is None and (self.host is None or node.id in self._writing):
            return False
        prefetch = node.pending if isinstance(node.pending, DiskLoad) else None
        if prefetch is None:
            node.pending = None  # any earlier transfer finished with the device copy it filled
        if spare is not None and len(spare) >= n:
            dev = spare[:n]
            del spare[:n]
        else:
            dev = self._allocate(DEVICE, n)
        if dev is None:
            self.stats.drops["device_full_on_load"] += n
            return False
        if prefetch is not None:  # its read is in flight: it lands in host memory, then copies here
            prefetch.to_device = True
        elif node.loc[1] is not None:
            if self.copier is None:
                node.pending = COMPLETED
            else:
                copies.append(node)
            self.stats.moved(HOST, DEVICE, n, self.page_bytes)
        else:
            host_pages = self._allocate(HOST, n)
            if host_pages is None:
                self.device.free(dev)
                self.stats.drops["host_full_on_load"] += n
                return False
            node.pending = DiskLoad(host_pages, eta=self._disk_eta(n))
            self._loading[node.id] = node
            self.worker.submit_read(node, node.loc[2], self._host_pages(host_pages))
        self._private.difference_update(dev)
        self.tree.set_location(node, DEVICE, dev)
        return True

    def _start_copies(self, nodes: list[TreeNode]) -> None:
        """Copy these nodes' host pages into their (just assigned) GPU pages in one copier call, one transfer
        for all: per-call costs (index uploads, stream waits, Python) are paid once per prefix, not per node."""
        if not nodes:
            return
        transfer = self.copier.to_device([p for n in nodes for p in n.loc[1]], [p for n in nodes for p in n.loc[0]])
        for node in nodes:
            node.pending = transfer

    def _host_pages(self, pages: Sequence[int]) -> list[Any]:
        """The buffers the L3 store reads and writes for these host pages (the ids themselves for a pool
        without bytes)."""
        view = getattr(self.host, "page_view", None)
        return [view(p) for p in pages] if view is not None else list(pages)

    def _disk_eta(self, pages: int) -> float:
        """When a read of `pages` submitted now should land: reads queue behind each other on the disk."""
        now = time.monotonic()
        bw = self.cost.disk_to_device_bytes_per_s
        start = max(now, self._disk_read_free_at)
        self._disk_read_free_at = start + (pages * self.page_bytes / bw if bw else 0.0)
        return self._disk_read_free_at

    def prefetch(self, tokens: Sequence[int], max_pages: int | None = None,
                 hold: PrefetchHold | None = None) -> PrefetchHold:
        """Hold a queued request's cached prefix in host memory until it is admitted.

        Pages only on disk start reading into host memory, so they travel while other requests compute
        and the request loads them from host when admitted (the GPU is not touched). Those nodes, and
        nodes an earlier prefetch brought in, are pinned (host eviction passes them over) until the caller
        gives the hold back with `release_prefetch`. Reads held at once cover at most half the host pool;
        the prefix is locked while host pages are found. A hold that stopped for lack of room is `short`;
        passing it back as `hold` (once other holds were released) goes on where it stopped.
        """
        retry = hold is not None
        hold = hold if retry else PrefetchHold()
        hold.short = False
        if not self.prefetch_enabled:
            return hold
        held = {id(node) for node, _ in hold.pins}
        m = self.match(tokens)
        budget = self.host.capacity_pages // 2 - self._prefetching
        self.tree.lock(m.last_node)  # host room is made from other pages than this prefix's
        pos, started = 0, 0
        try:
            for node, tier in m.segments:
                if node.pending is FAILED or node.id in self._invalid:
                    break
                if max_pages is not None and pos >= max_pages:
                    break
                pos += node.num_pages
                n = node.num_pages
                if id(node) in held:
                    continue
                if node.loc[0] is None and ((node.pending is PREFETCHED and node.loc[1] is not None)
                                            or isinstance(node.pending, DiskLoad)):
                    self.tree.pin(node)  # brought in (or coming) for another queued request: hold it too
                    hold.pins.append((node, 0))
                elif tier == DISK and node.loc[1] is None:
                    if n > budget - started:
                        # short (worth asking again) unless it could not fit even with every other hold released
                        own = sum(k for _, k in hold.pins)
                        hold.short = n <= self.host.capacity_pages // 2 - own
                        break
                    host_pages = self._allocate(HOST, n)
                    if host_pages is None:
                        if not retry:  # counted once per request, not once per step it asks again
                            self.stats.drops["host_full_on_prefetch"] += n
                        hold.short = True
                        break
                    node.pending = DiskLoad(host_pages, to_device=False, prefetch=True, eta=self._disk_eta(n))
                    self._loading[node.id] = node
                    self.worker.submit_read(node, node.loc[2], self._host_pages(host_pages))
                    self.tree.pin(node)
                    self._prefetching += n
                    started += n
                    hold.pins.append((node, n))
        finally:
            self.tree.unlock(m.last_node)
        hold.started += started
        self.stats.prefetched_pages += started
        return hold

    def release_prefetch(self, hold: PrefetchHold) -> None:
        """Give back a prefetch hold (the request was admitted, or left the queue)."""
        for node, n in hold.pins:
            self.tree.unpin(node)
            self._prefetching -= n
        hold.pins = []
        self._remove_invalid()

    def wait_ticket(self, ticket: LoadTicket, timeout: float | None = None) -> bool:
        """Block until the ticket is ready (for callers with nothing else to do); False on timeout."""
        while not ticket.ready():
            if any(isinstance(n.pending, DiskLoad) for n in ticket.nodes):
                if not self.worker.wait_idle(timeout):
                    return False
            self.poll()
        for node in ticket.nodes:
            if node.pending is not None and node.pending is not FAILED:
                node.pending.wait()
        return True

    def launch_loads(self) -> int:
        """Start the loads a `tiers.LaunchLater` copier holds (the engine calls this once its forward step is
        queued); returns how many. No-op with any other copier: their loads started when asked for."""
        launch = getattr(self.copier, "launch", None)
        return launch() if launch is not None else 0

    def stream_wait(self, ticket: LoadTicket) -> None:
        """Make the current CUDA stream wait for the copies of the pages the caller may read now: the
        whole prefix, or only [0, k) while the ticket has a gap (no host blocking); no-op on CPU."""
        for node in ticket.prefix_nodes:
            wait = getattr(node.pending, "stream_wait", None)
            if wait is not None:
                wait()

    # ------------------------------------------------------------------ committing computed pages

    def alloc_device(self, n: int) -> list[int] | None:
        """n private GPU pages for new KV, evicting cached pages as needed; None if impossible."""
        pages = self._allocate(DEVICE, n)
        if pages is not None:
            self._private.update(pages)
            if self._deferred and not self._deferring():
                self._flush_slice()
        return pages

    def free_device(self, pages: Sequence[int]) -> None:
        """Return private GPU pages (not committed to the tree)."""
        self._private.difference_update(pages)
        self.device.free(pages)

    def commit(self, ticket: LoadTicket, tokens: Sequence[int], device_pages: Sequence[int]) -> list[int]:
        """Insert the full pages of tokens (the ticket's prefix plus new ones) into the tree.

        device_pages covers every full page of tokens; its first ticket.num_pages entries must be the
        ticket's own pages. Returns the canonical GPU pages for all full pages: where another request
        committed the same pages first, the tree's copies win and the caller's duplicates are freed.
        The ticket's lock moves to the new deepest node. Write policies fire for the new pages.
        """
        ps = self.page_size
        if ticket.gap is not None:
            raise ValueError(f"commit: the ticket's gap {ticket.gap} is not committed yet (commit_gap)")
        have = ticket.num_pages
        full = len(tokens) // ps
        if len(device_pages) < full:
            raise ValueError(f"commit: {full} full pages of tokens but {len(device_pages)} GPU pages")
        if full <= have:
            return ticket.device_pages()[:full]
        new_pages = list(device_pages[have:full])
        node, dups = self.tree.insert(tokens[have * ps : full * ps], new_pages, DEVICE, start=ticket.node)
        self._private.difference_update(new_pages)
        if dups:
            dup_set = set(dups)
            self._private.update(dup_set)
            self.free_device([p for p in new_pages if p in dup_set])
        path = []
        walk = node
        while walk is not ticket.node:
            path.append(walk)
            walk = walk.parent
        path.reverse()
        self.tree.lock(node)
        self.tree.unlock(ticket.node)
        ticket.node = node
        if self.host is not None and self.policy.device_to_host == "write_through":
            self._write_through(path)
        return ticket.device_pages()

    def commit_gap(self, ticket: LoadTicket, tokens: Sequence[int], device_pages: Sequence[int]) -> list[int]:
        """Adopt the caller's computed pages [k, k + len(device_pages)) of the ticket's gap [k, s).

        tokens covers at least those pages. The gap nodes take the pages as their GPU copy; where a
        node got GPU pages meanwhile (another request loaded or committed it), the tree's pages win, the
        caller's are freed, and the ticket may not be `ready` until that load lands. Returns the
        canonical GPU pages of [k, k + len(device_pages)). The gap shrinks to what is left (None when
        all of it is committed: the ticket is then an ordinary one). Write policies fire.
        """
        if ticket.gap is None:
            raise ValueError("commit_gap: the ticket has no gap")
        ps = self.page_size
        k, s = ticket.gap
        end = k + len(device_pages)  # pages [k, end) are committed now
        if end > s or len(tokens) < end * ps:
            raise ValueError(f"commit_gap: pages [{k}, {end}) for gap [{k}, {s}) and {len(tokens)} tokens")
        if end == k:
            return []
        start = ticket.part(0, k)[-1] if k else self.tree.root
        new_pages = list(device_pages)
        node, dups = self.tree.insert(tokens[k * ps : end * ps], new_pages, DEVICE, start=start)
        if node not in ticket.nodes:
            raise AssertionError(f"commit_gap: tokens do not follow the ticket's path ({node})")
        self._private.difference_update(new_pages)
        if dups:
            dup_set = set(dups)
            self._private.update(dup_set)
            self.free_device([p for p in new_pages if p in dup_set])
        ticket.gap = (end, s) if end < s else None
        part = ticket.part(k, end)
        if self.host is not None and self.policy.device_to_host == "write_through":
            self._write_through(part)
        return [p for n in part for p in n.loc[0]]

    def release(self, ticket: LoadTicket) -> None:
        """Drop the ticket's lock; failed loads are cleaned up once nobody holds them."""
        if ticket.released:
            raise ValueError("ticket released twice")
        ticket.released = True
        self.tree.unlock(ticket.node)
        ticket.node = self.tree.root
        self._remove_invalid()

    # ------------------------------------------------------------------ write policies

    def _deferring(self) -> bool:
        """Whether new write-through copies wait: the policy allows it and the GPU pool has room to spare."""
        p = self.policy
        return p.defers_backups and self.device.allocator.free_pages > p.defer_above_free * self.device.capacity_pages

    def _write_through(self, nodes: list[TreeNode]) -> None:
        """Back up newly committed nodes now, or queue them while the GPU pool has room (deferred write-through)."""
        if self._deferring():
            self._deferred.extend(nodes)
            self.stats.deferred_pages += sum(n.num_pages for n in nodes)
            return
        self._flush_slice()
        for node in nodes:
            self._backup_to_host(node)

    def begin_step(self) -> None:
        """The engine starts a step: renew the step's slice of the deferred backlog (`flush_slice_pages`)."""
        self._flush_budget = self.flush_slice_pages

    def idle(self) -> None:
        """The engine has nothing to run: start deferred write-through copies (this step's slice) while they cost
        nothing."""
        self._flush_slice()

    def _flush_slice(self) -> None:
        """Start what is left of this step's slice of the deferred backlog."""
        if self._deferred and self._flush_budget > 0:
            self._flush_budget -= self.flush_backups(self._flush_budget)

    def flush_backups(self, limit: int | None = None) -> int:
        """Start deferred write-through copies, oldest first, until `limit` pages (whole nodes; None: all) have
        started; returns the pages copied.

        Once free GPU pages fall to the policy's share, GPU allocations and commits start the step's slice
        (`begin_step`; new commits are then copied at once, so the backlog only shrinks), and so does the engine
        when it idles (so a burst's KV reaches host memory, and L3, once the burst is over); shutdown starts all.
        A queued page evicted before its turn is copied on its way out. A queued node may have been split since
        (its upper part is then an ancestor, which may still wait after the lower part was evicted), evicted, or
        copied already. So each queued node's path is walked up to the first GPU node with a host copy.
        """
        copied = 0
        while self._deferred and (limit is None or copied < limit):
            chain = []
            walk = self._deferred.popleft()
            while walk.parent is not None and (walk.loc[0] is None or walk.loc[1] is None):
                if walk.loc[0] is not None:
                    chain.append(walk)
                walk = walk.parent
            for node in reversed(chain):
                if self._backup_to_host(node):
                    copied += node.num_pages
        return copied

    def _selective_backups(self, nodes: list[TreeNode]) -> None:
        """Back up hit pages that a selective policy now admits; retry write-through that was refused
        earlier (full queue, or the L3 admission rule, which counts these hits)."""
        hits = self.policy.selective_hits
        for node in nodes:
            if self.host is not None and node.loc[1] is None and self.policy.device_to_host == "write_through" and (
                not self._deferring()
            ):
                self._backup_to_host(node)  # its host copy was evicted while the GPU kept it: copy it again
            if self.l3 is not None and node.loc[1] is not None and node.loc[2] is None and (
                self.policy.host_to_disk == "write_through"
            ):
                note = getattr(self.l3, "note_hit", None)
                if note is not None:
                    note(node.keys)
                self._write_to_disk(node)
            if node.hit_count < hits:
                continue
            if self.host is not None and node.loc[1] is None and node.loc[0] is not None and (
                self.policy.device_to_host == "write_through_selective"
            ):
                self._backup_to_host(node)
            if node.loc[1] is not None and self.policy.host_to_disk == "write_through_selective":
                self._write_to_disk(node)

    def _backup_to_host(self, node: TreeNode) -> bool:
        """Copy a node's GPU pages to new host pages; False (counted) if the host is full."""
        if node.loc[1] is not None or node.loc[0] is None:
            return node.loc[1] is not None
        if node.pending is FAILED or (node.pending is not None and not node.pending.done()):
            return False
        n = node.num_pages
        host_pages = self._allocate(HOST, n, protect=node)
        if host_pages is None:
            self.stats.drops["host_full"] += n
            return False
        handle = self.copier.to_host(node.loc[0], host_pages) if self.copier else COMPLETED
        if handle is not COMPLETED:
            self._backups.update(dict.fromkeys(node.loc[0], handle))
        self.tree.set_location(node, HOST, host_pages)
        self.stats.moved(DEVICE, HOST, n, self.page_bytes)
        if self.l3 is not None and self.policy.host_to_disk == "write_through":
            self._write_to_disk(node, handle)
        return True

    def _write_to_disk(self, node: TreeNode, handle: TransferHandle | None = None, bounce: bool = False) -> bool:
        """Queue an L3 write of a node's host pages. Without `bounce` the node stays pinned in host memory
        until the write completes; with it the bytes are copied first so the host pages can be freed now."""
        if self.l3 is None or node.loc[2] is not None or node.id in self._writing or node.loc[1] is None:
            return node.loc[2] is not None
        n = node.num_pages
        # a full queue refuses the write (below, too): found out first, before disk pages are evicted to make
        # room for it and before one page view (or, bouncing, one copy) per page is made, all for nothing.
        # Under write-through the queue is full for most of a long burst.
        if self.worker.queued_write_pages + n > self.worker.queue_pages:
            self.stats.drops["l3_queue_full"] += n
            return False
        if not self._make_disk_room(n):
            self.stats.drops["disk_full"] += n
            return False
        if handle is not None and bounce:
            handle.wait()
        pages = self._host_pages(node.loc[1])
        if bounce and pages and isinstance(pages[0], torch.Tensor):
            pages = [p.clone() for p in pages]
        before = handle.wait if handle is not None and not bounce else None
        if not self.worker.submit_write(node, node.keys, pages, before):
            self.stats.drops["l3_queue_full"] += n
            return False
        self._writing[node.id] = node
        if bounce:  # the write owns its bytes: record the page as on disk now so the node may leave host
            self._bounced.add(node.id)
            self.tree.set_location(node, DISK, list(node.keys))
        else:  # the host pages must outlive the write: pin them (the GPU copy may still be evicted)
            self._disk_inflight += n
            self.tree.pin(node)
        self.stats.moved(HOST, DISK, n, self.page_bytes)
        return True

    # ------------------------------------------------------------------ completions

    def poll(self) -> None:
        """Apply finished L3 I/O to the tree (call once per scheduler step)."""
        if self.worker is None:
            return
        for c in self.worker.completions():
            node: TreeNode = c.token
            n = len(c.results)
            if c.kind == "write":
                self._writing.pop(node.id, None)
                if node.id in self._bounced:
                    self._bounced.discard(node.id)
                    if not all(c.results):  # recorded on disk at submit; undo, with what hangs below
                        self.stats.drops["l3_write_failed"] += c.results.count(False)
                        if node.parent is not None:
                            self._invalid[node.id] = node
                    continue
                self._disk_inflight -= n
                self.tree.unpin(node)
                if all(c.results):
                    for part in self._pieces(node, lambda p, keys=c.keys: p.keys[0] in keys):
                        if part.loc[2] is None:
                            self.tree.set_location(part, DISK, list(part.keys))
                else:
                    self.stats.drops["l3_write_failed"] += c.results.count(False)
            else:
                self._loading.pop(node.id, None)
                load: DiskLoad = node.pending
                parts = self._pieces(node, lambda p, load=load: p.pending is load)  # the node may have been split
                if all(c.results):
                    offset = 0
                    for part in parts:
                        host_pages = load.host_pages[offset : offset + part.num_pages]
                        offset += part.num_pages
                        self.tree.set_location(part, HOST, host_pages)
                        if load.to_device and part.loc[0] is not None:
                            part.pending = self.copier.to_device(host_pages, part.loc[0]) if self.copier else COMPLETED
                            self.stats.moved(HOST, DEVICE, part.num_pages, self.page_bytes)
                        else:
                            part.pending = PREFETCHED if load.prefetch else None
                    self.stats.moved(DISK, HOST, n, self.page_bytes)
                    self._observe_disk_read(n * self.page_bytes, c.seconds)
                else:
                    self.host.free(load.host_pages)
                    self.stats.load_failures += 1
                    for part in parts:
                        part.pending = FAILED
                        self._invalid[part.id] = part
        self._remove_invalid()

    def _observe_disk_read(self, nbytes: int, seconds: float) -> None:
        """Fold a measured L3 read into the cost model's disk bandwidth (EWMA), so decisions follow the disk."""
        if seconds <= 0 or not self.cost.adaptive:
            return
        measured = nbytes / seconds
        old = self.cost.disk_to_device_bytes_per_s
        new = measured if not old else 0.8 * old + 0.2 * measured
        self.cost = dataclasses.replace(self.cost, disk_to_device_bytes_per_s=new)

    @staticmethod
    def _pieces(node: TreeNode, belongs: Any) -> list[TreeNode]:
        """node and the ancestors split off it that still belong to the same transfer, top-down."""
        parts = [node]
        while parts[0].parent is not None and parts[0].parent.parent is not None and belongs(parts[0].parent):
            parts.insert(0, parts[0].parent)
        return parts

    def _remove_invalid(self) -> None:
        for key, node in list(self._invalid.items()):
            if node.lock_ref > 0 or node.pin_ref > 0:
                continue
            del self._invalid[key]
            if node.parent is None:
                continue
            node.pending = None
            if node.loc[2] is not None and self.l3 is not None:
                self.l3.delete(node.loc[2])
            self._free_nodes(self.tree.remove_subtree(node))

    # ------------------------------------------------------------------ allocation and eviction

    def _pool(self, tier: str) -> Any:
        return self.device if tier == DEVICE else self.host

    def _allocate(self, tier: str, n: int, protect: TreeNode | None = None) -> list[int] | None:
        pool = self._pool(tier)
        if n > pool.capacity_pages:
            return None
        if pool.allocator.free_pages < n:
            self._evict(tier, n - pool.allocator.free_pages, protect)
        return pool.allocate(n)

    def _evict(self, tier: str, need: int, protect: TreeNode | None = None) -> int:
        """Evict least recently used unlocked leaves of a tier until `need` pages are free there."""
        freed = 0
        skip = (lambda node: node is protect) if protect is not None else None
        while freed < need:
            node = self.tree.pop_evictable(tier, skip)
            if node is None:
                break
            freed += self._evict_node(tier, self._tail(node, need - freed))
        return freed

    def _tail(self, node: TreeNode, pages: int) -> TreeNode:
        """The last `pages` pages of node as their own node (split off), or node if it is no larger.

        Eviction is per page: within a node the last pages are the least valuable (a parent outlives
        its children), so only as many as needed leave the tier.
        """
        if node.num_pages <= pages:
            return node
        self.tree.split(node, node.num_pages - pages)
        return node  # after the split, `node` keeps the tail

    def _evict_node(self, tier: str, node: TreeNode) -> int:
        n = node.num_pages
        if tier == DEVICE:
            if self.host is not None and node.loc[1] is None and (
                self.policy.device_to_host == "write_back" or self.policy.defers_backups
            ):
                if self._backup_to_host(node):  # its copy is waited for when the pages are freed, below
                    self.stats.eviction_backups += n
        elif tier == HOST:
            if self.l3 is not None and node.loc[2] is None and node.id not in self._writing and (
                self.policy.host_to_disk == "write_back"
            ):
                self._write_to_disk(node, bounce=True)
        self.stats.evictions[tier] += n
        if tier == DEVICE and not isinstance(node.pending, DiskLoad):
            node.pending = None  # a finished promotion into the pages being freed
        pages, orphans = self.tree.clear_location(node, tier)
        if tier == DISK:
            self.l3.delete(pages)
        elif tier == DEVICE:
            self._free_device_pages(pages)
        else:
            self.host.free(pages)
        self._free_nodes(orphans)
        return n

    def _free_device_pages(self, pages: Sequence[int]) -> None:
        """Free tree-owned GPU pages. Compute may overwrite them next, so the current stream first waits
        (on the GPU; the host does not block) for any GPU -> host copy still reading them. Only those
        copies: waiting for every copy in flight made each eviction wait for the newest backups too."""
        waits = {}
        for p in pages:
            handle = self._backups.pop(p, None)
            if handle is not None and not handle.done():
                waits[id(handle)] = handle
                self.stats.backup_waits += 1
        for handle in waits.values():
            wait = getattr(handle, "stream_wait", None)
            if wait is not None:
                wait()
            else:
                handle.wait()
        self.device.free(pages)

    def _make_disk_room(self, n: int) -> bool:
        """Evict L3 leaves until n more pages fit under the disk capacity."""
        if n > self.disk_capacity:
            return False
        while (over := self.tree.pages_in[2] + self._disk_inflight + n - self.disk_capacity) > 0:
            node = self.tree.pop_evictable(DISK)
            if node is None:
                return False
            self._evict_node(DISK, self._tail(node, over))
        return True

    def _free_nodes(self, nodes: list[TreeNode]) -> None:
        """Free every page of removed nodes in every tier."""
        for node in nodes:
            if node.loc[0] is not None:
                self._free_device_pages(node.loc[0])
                self.stats.evictions[DEVICE] += node.num_pages
            if node.loc[1] is not None:
                self.host.free(node.loc[1])
                self.stats.evictions[HOST] += node.num_pages
            if node.loc[2] is not None:
                self.l3.delete(node.loc[2])
                self.stats.evictions[DISK] += node.num_pages
            node.loc = [None, None, None]

    # ------------------------------------------------------------------ inspection

    def usage(self) -> dict[str, dict[str, int]]:
        """Used and capacity pages per tier."""
        out = {DEVICE: {"used": self.device.used_pages(), "capacity": self.device.capacity_pages}}
        if self.host is not None:
            out[HOST] = {"used": self.host.used_pages(), "capacity": self.host.capacity_pages}
        if self.l3 is not None:
            out[DISK] = {"used": self.tree.pages_in[2], "capacity": self.disk_capacity}
        return out

    def check_integrity(self) -> None:
        """Tree integrity plus, per pool, free + owned == capacity with no page owned twice."""
        self.tree.check_integrity()
        self.device.allocator.check_integrity(self.tree.owned_pages(DEVICE) + sorted(self._private))
        if self.host is not None:
            loading = [p for node in self._loading.values() for p in node.pending.host_pages]
            self.host.allocator.check_integrity(self.tree.owned_pages(HOST) + loading)
        if self.tree.pages_in[2] + self._disk_inflight > self.disk_capacity and self.l3 is not None:
            raise AssertionError(f"disk tier holds {self.tree.pages_in[2]} + {self._disk_inflight} pages "
                                 f"> capacity {self.disk_capacity}")

    def close(self) -> None:
        """Start the deferred host copies (and so their L3 write-through, as far as the L3 queue takes them),
        finish queued L3 writes and apply them."""
        if self._deferred:
            self.flush_backups()
        if self.worker is not None:
            self.worker.wait_idle()
            self.poll()
            self.worker.close()
