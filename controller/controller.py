"""The tier controller: the cache as one small service over its parts, with one-way dependencies.

    Lookup    match + L3 probe                          (tree, L3 index)
    Eviction  room per tier, freeing removed nodes      (tree, pools, transfers)
    Writes    write policies as strategies              (Eviction)
    Loads     plans, copies, tickets, disk reads        (Eviction, cost model)
    Prefetch  reads for queued requests                 (Loads, Writes)
    Staging   GPU copies for queued requests            (Loads)
    Commits   a request's GPU pages into the tree       (Eviction, Writes)

The tree holds where pages live; the controller's `Transfers` table holds what is moving them. A
request's life: `acquire(tokens)` matches, plans and starts loads and returns a ticket holding a
lock; `ticket.ready()` says when its cached pages are usable; the caller computes the rest into
pages from `alloc_device`; `commit(ticket, tokens, pages)` inserts them (write policies fire);
`release(ticket)` drops the lock; `free_device` returns private pages. With `acquire(...,
overlap=True)` the ticket may have a gap [k, s) the caller computes while [s, n) loads;
`commit_gap` adopts those pages (see LoadTicket).

The scheduler brackets each engine step with `step()`: it renews the step's slice of deferred
backups and applies finished L3 I/O on entry, and starts held loads on exit. Threading: every
method runs on one thread (the scheduler's); copies are asynchronous, L3 I/O runs on an L3Worker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from controller.commits import Commits
from controller.cost import CostModel
from controller.eviction import Eviction
from controller.loads import Loads
from controller.lookup import Lookup
from controller.policy import WritePolicy
from controller.ports import L3, NO_HOST, NO_L3, NO_WORKER, Copier, HostTier, InstantCopier, Pool, Worker
from controller.prefetch import Prefetcher
from controller.reuse import ReuseFilter, reuse_memory
from controller.staging import Staging
from controller.stats import CacheStats
from controller.ticket import LoadTicket, PrefetchHold
from controller.transfers import Transfers
from controller.write_policies import NoWrites, tier_writes
from controller.writes import Writes
from radix import DEFAULT_NAMESPACE, DEVICE, DISK, HOST, CacheNamespace, MatchResult, RadixTree
from tiers.copy import FencedCopier, LaunchLater
from tiers.l3.worker import L3Worker

logger = logging.getLogger(__name__)


class TierController:
    """Moves pages between a GPU pool, an optional host pool and an optional L3 store; see the module doc.

    `launch_later`: loads start at the end of the step that asked for them (`step()`), once the engine
    has queued its forward, instead of at once (`tiers.LaunchLater`).
    """

    def __init__(
        self,
        tree: RadixTree,
        device: Pool,
        host: HostTier | None = None,
        l3: L3 | None = None,
        copier: Copier | None = None,
        write_policy: WritePolicy | None = None,
        cost: CostModel | None = None,
        l3_worker: Worker | None = None,
        disk_capacity_pages: int | None = None,
        prefetch: bool = True,
        launch_later: bool = False,
        prefetch_host_share: float = 0.5,
        prefetch_queue_s: float = 0.0,
        stage: bool = True,
    ):
        if l3 is not None and host is None:
            raise ValueError("the disk tier needs a host tier: pages reach L3 through host memory")
        policy = write_policy or WritePolicy()
        self.tree = tree
        self.device = device
        self.host: HostTier = host if host is not None else NO_HOST
        self.l3: L3 = l3 if l3 is not None else NO_L3
        copier = copier if copier is not None else InstantCopier()
        self.launch_later = launch_later and not isinstance(copier, InstantCopier)
        # a copier launched later is one of the tiers' fenced copiers (tiers.copy.FencedCopier)
        self.copier: Copier = LaunchLater(cast(FencedCopier, copier)) if self.launch_later else copier
        self.worker: Worker = l3_worker if l3_worker is not None else L3Worker(l3) if l3 is not None else NO_WORKER
        self.page_size = tree.page_size
        self.page_bytes = device.page_bytes
        self.stats = CacheStats()
        self.transfers = Transfers(tree)
        disk_capacity = disk_capacity_pages if disk_capacity_pages is not None else self.l3.capacity_pages
        self.eviction = Eviction(tree, device, self.host, self.l3, self.transfers, self.stats, disk_capacity)
        self.lookup = Lookup(tree, self.l3)
        to_host = tier_writes(policy.device_to_host, policy, deferrable=True) if host is not None else NoWrites()
        to_disk = tier_writes(policy.host_to_disk, policy) if l3 is not None else NoWrites()
        self.writes = Writes(tree, device, self.host, self.l3, self.copier, self.worker, self.eviction,
                             self.transfers, self.stats, to_host, to_disk, self.page_bytes, policy.l3_host_share,
                             ReuseFilter(policy.l3_admit, reuse_memory(self.host.capacity_pages, disk_capacity)))
        self.loads = Loads(tree, device, self.host, self.copier, self.worker, self.eviction, self.transfers,
                           self.stats, cost or CostModel(tree.page_size, device.page_bytes),
                           prefetch and l3 is not None, shared_pages=getattr(self.l3, "shared_pages", None),
                           staging_share=prefetch_host_share)
        self.prefetcher = Prefetcher(self.loads, tree, self.match, self.writes.hit, lambda: self.host_room_version,
                                     prefetch_queue_s)
        self.staging = Staging(self.loads, tree, self.match, self.stats, stage)
        self.commits = Commits(tree, device, self.eviction, self.writes)
        # counts the events that can give host memory back to a prefetch (a ticket or hold released, I/O applied):
        # a hold that stopped short is not asked again until one has happened (see `prefetch`)
        self.host_room_version = 0

    @property
    def cost(self) -> CostModel:
        """The load-or-recompute model (its disk bandwidth follows measured reads)."""
        return self.loads.cost

    @cost.setter
    def cost(self, cost: CostModel) -> None:
        self.loads.cost = cost

    # ------------------------------------------------------------------ the engine step

    @contextmanager
    def step(self) -> Iterator[None]:
        """One engine step: renew its slice of deferred backups and apply finished L3 I/O, then (on exit,
        after the caller queued its forward) start the loads the step asked for."""
        self.writes.begin_step()
        self.poll()
        try:
            yield
        finally:
            self.launch_loads()

    def fence_forward(self) -> None:
        """Just before a forward is queued: loads and backups asked for until the step ends wait only for the
        compute queued so far, not for that forward (`LaunchLater.pin_fence`; no-op with other copiers)."""
        pin = getattr(self.copier, "pin_fence", None)
        if pin is not None:
            pin()

    def launch_loads(self) -> int:
        """Start the loads a `LaunchLater` copier holds; returns how many (0 with other copiers)."""
        launch = getattr(self.copier, "launch", None)
        return launch() if launch is not None else 0

    def idle(self) -> None:
        """The engine has nothing to run: start deferred backups (this step's slice) while they cost little (none for
        one-off traffic: HostBackups.flush_slice)."""
        self.writes.flush_slice()

    # ------------------------------------------------------------------ requests

    def match(self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE,
              reference: bool = True) -> MatchResult:
        """Longest cached prefix of tokens in `namespace`, extended by an L3 index probe past the in-memory tree.
        `reference`: the match is a use of the prefix, counted as a hit (not a queued request looking again)."""
        return self.lookup.match(tokens, self.tree.namespaces.get(namespace.id, namespace.group), reference)

    def set_shares(self, shares: dict[int, float]) -> None:
        """Give share groups (tenants) a fraction of every tier's capacity: a tier that must make room takes it
        from the groups over their share first, so one tenant's traffic does not flush another's cache
        (radix.order). Groups not named have no share; {} turns shares off."""
        capacities = {DEVICE: self.device.capacity_pages, HOST: self.host.capacity_pages,
                      DISK: self.eviction.disk_capacity}
        for tier, capacity in capacities.items():
            self.tree.set_quotas(tier, {group: int(capacity * share) for group, share in shares.items()})

    def acquire(self, tokens: Sequence[int], max_pages: int | None = None, overlap: bool = False,
                replaces: LoadTicket | None = None, namespace: CacheNamespace = DEFAULT_NAMESPACE,
                busy: bool = False) -> LoadTicket:
        """Match tokens, decide how much of the cached prefix to use (at most max_pages: callers keep a token to
        compute), lock it and start its loads; with `overlap` the ticket may have a gap the caller computes while
        the rest loads (see Loads.acquire, LoadTicket and commit_gap). `busy`: the GPU has other requests' work
        queued, so host pages load rather than being recomputed (CostModel). Write policies see the hits. `replaces`:
        the request's earlier ticket, whose load failed: its prompt is not counted again and its hits, which were
        not served, are taken back. `namespace`: the part of the cache the request may match and fill."""
        self.poll()
        m = self.match(tokens, namespace)
        if replaces is None:
            self.stats.prompt_tokens += len(tokens)
            self.writes.reuse.requested(m.num_pages > 0)
        else:
            for tier, pages in replaces.hit_pages.items():
                self.stats.hit_tokens[tier] -= pages * self.page_size
        ticket = self.loads.acquire(m, max_pages, overlap, busy)
        self.writes.hit(ticket.nodes)
        return ticket

    def prefetch(self, tokens: Sequence[int], max_pages: int | None = None,
                 hold: PrefetchHold | None = None, namespace: CacheNamespace = DEFAULT_NAMESPACE) -> PrefetchHold:
        """Start reading a queued request's disk-only prefix into host memory, pinned there until the hold is given
        back (`release_prefetch`), so at admission it loads from host; a hold passed back goes on where it stopped,
        or rechecks the prefix (Prefetcher.prefetch)."""
        return self.prefetcher.prefetch(tokens, max_pages, hold, namespace)

    def release_prefetch(self, hold: PrefetchHold) -> None:
        """Give back a prefetch hold (the request was admitted, or left the queue)."""
        self.prefetcher.release(hold)
        self.host_room_version += 1
        self.eviction.remove_invalid()

    def alloc_device(self, n: int) -> list[int] | None:
        """n private GPU pages for new KV, evicting cached pages as needed; None if impossible (Commits)."""
        return self.commits.alloc_device(n)

    def free_device(self, pages: Sequence[int]) -> None:
        """Return private GPU pages (not committed to the tree)."""
        self.commits.free_device(pages)

    def commit(self, ticket: LoadTicket, tokens: Sequence[int], device_pages: Sequence[int]) -> list[int]:
        """Insert a request's computed pages and move its ticket's lock down to them (Commits.commit)."""
        return self.commits.commit(ticket, tokens, device_pages)

    def commit_gap(self, ticket: LoadTicket, tokens: Sequence[int], device_pages: Sequence[int]) -> list[int]:
        """Adopt pages computed in a ticket's gap (Commits.commit_gap)."""
        return self.commits.commit_gap(ticket, tokens, device_pages)

    def release(self, ticket: LoadTicket) -> None:
        """Drop the ticket's lock; failed loads are cleaned up once nobody holds them."""
        if ticket.released:
            raise ValueError("ticket released twice")
        ticket.released = True
        self.tree.unlock(ticket.node)
        ticket.node = self.tree.root
        self.host_room_version += 1
        self.eviction.remove_invalid()

    def pending_reads(self, ticket: LoadTicket) -> tuple[float, float]:
        """What the ticket still waits for from disk: (seconds the GPU would take to recompute it, seconds until
        the reads should land); (inf, 0) where it waits for none or the prefill speed is unknown. How long its
        request may wait for them (see give_up_reads and controller/give_up.py)."""
        return self.loads.deadlines.pending_reads(ticket)

    def give_up_reads(self, ticket: LoadTicket) -> LoadTicket | None:
        """Stop waiting for the ticket's disk reads that have not landed: the ticket now ends before them and the
        caller computes the rest. Returns a ticket to release once its transfers settle (the reads go on into
        host memory), or None if there was nothing to give up (controller/give_up.py)."""
        residual = self.loads.deadlines.give_up_reads(ticket)
        if residual is not None:
            self.host_room_version += 1
        return residual

    def load_waits(self, ticket: LoadTicket) -> list[Any]:
        """The copies still bringing pages the caller may read now (the whole prefix, or [0, k) while the ticket has
        a gap), each once: its forward waits for them on the GPU, layer by layer where they are layered
        (`tiers.layered_copy.layer_waits`)."""
        handles = {id(h): h for n in ticket.prefix_nodes if (h := self.transfers.in_flight_copy(n)) is not None}
        return list(handles.values())

    def wait_ticket(self, ticket: LoadTicket, timeout: float | None = None) -> bool:
        """Block until the ticket is ready (for callers with nothing else to do); False on timeout."""
        while not ticket.ready():
            if any(self.transfers.disk_load(n) is not None for n in ticket.nodes):
                if not self.worker.wait_idle(timeout):
                    return False
            self.poll()
        for node in ticket.nodes:
            self.transfers.wait(node)
        return True

    # ------------------------------------------------------------------ I/O, inspection, shutdown

    def poll(self) -> None:
        """Apply finished L3 I/O to the tree (the scheduler calls it once per step, through `step`)."""
        for c in self.worker.completions():
            (self.writes if c.kind == "write" else self.loads).apply(c)
            self.host_room_version += 1
        if self.writes.waiting_disk:
            self.writes.drain_waiting()
        else:
            self.writes.drain_spare()
        self.eviction.remove_invalid()
        if self.eviction.landing and self.eviction.reap_host_frees():
            self.host_room_version += 1
        self.tree.namespaces.prune()  # no unlocked namespace root is held between steps

    def gauges(self) -> dict[str, int]:
        """GPU pages in use, and GPU pages freed while their copy to host was in flight (a counter)."""
        return {"device_used_pages": self.device.used_pages(), "backup_waits": self.stats.backup_waits}

    def report(self) -> dict[str, Any]:
        """Counters, tier usage and the cost model, for the engine's stats and /metrics."""
        cache = {**self.stats.snapshot(), "l3_write_waiting_pages": self.writes.waiting_disk_pages}
        groups = {tier: self.tree.group_pages(tier) for tier in (DEVICE, HOST, DISK)}
        return {"cache": cache, "tiers": self.usage(), "group_pages": groups, "cost_model": self.cost.describe()}

    def usage(self) -> dict[str, dict[str, int]]:
        """Used and capacity pages per tier present."""
        out = {DEVICE: {"used": self.device.used_pages(), "capacity": self.device.capacity_pages}}
        if self.host.capacity_pages:
            out[HOST] = {"used": self.host.used_pages(), "capacity": self.host.capacity_pages}
        if self.l3.capacity_pages:  # the store's count: it also holds pages written before a restart
            out[DISK] = {"used": self.l3.used_pages(), "capacity": self.eviction.disk_capacity}
        return out

    def check_integrity(self) -> None:
        """Tree integrity plus, per pool, free + owned == capacity with no page owned twice."""
        self.tree.check_integrity()
        self.device.allocator.check_integrity(self.tree.owned_pages(DEVICE) + sorted(self.commits.private))
        self.host.allocator.check_integrity(self.tree.owned_pages(HOST) + list(self.loads.loading_host_pages())
                                            + self.eviction.landing_host_pages())
        self.writes.check_integrity()
        ev = self.eviction
        if self.tree.pages_in[2] + ev.disk_inflight > ev.disk_capacity:
            raise AssertionError(f"disk tier holds {self.tree.pages_in[2]} + {ev.disk_inflight} pages "
                                 f"> capacity {ev.disk_capacity}")

    def close(self) -> None:
        """Start the deferred backups (and so their L3 write-through, as far as the L3 queue takes them),
        finish queued L3 writes and apply them."""
        self.writes.finish(self.poll)
        self.eviction.reap_host_frees(wait=True)
        self.worker.close()
