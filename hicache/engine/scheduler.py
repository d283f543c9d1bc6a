"""Continuous batching over the tier controller: admission, chunked prefill, batched decode, preemption.

Each step the scheduler (1) applies finished I/O (`poll`) and moves requests whose cached prefix has
reached the GPU from LOADING to RUNNING, (2) admits waiting requests while the running requests' prefill
backlog is below one step's token budget (one LOADING for its prefix has nothing the GPU can compute yet), and
starts L3 -> host prefetches of the disk pages of those still waiting, and (3) plans the step: one token
for every decoding request, then prefill chunks (oldest first) within `chunk_tokens`, taking no further
request once the step holds `batch_tokens` prefill tokens. Once the step's forward is queued, the host pages of
the waiting requests' prefixes are copied into the GPU pages the admitted requests do not need (staging), so that
at admission their prefix is there (hicache/engine/waiting.py). New KV goes into
private pages from `alloc_device`; when none are left the most recently admitted request is preempted
(its full pages committed, so its prefix stays cached and a re-admission hits it). Full pages are
committed as soon as they are computed. With `admit_ahead` (scheduler.admit_during_forward) steps (1)-(2) also
run while the previous step's forward is on the GPU.

The scheduler is the cache's one caller: every tree and controller call of an engine step is made here,
inside `step()`, and the engine only sees the plan.

A request whose ticket has a gap (cache.load_policy.overlap) starts RUNNING once pages [0, k) are on the
GPU and prefills the gap [k, s) while [s, n) loads; when the gap is computed it is committed whole
(`commit_gap`), the request jumps to token n * page_size and, if the tail has not landed yet, waits in
LOADING like any request. Stopped mid-gap (preempted, aborted) it commits the gap pages it filled.
All methods run on the engine thread.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from controller import LoadTicket, TierController
from hicache.engine.request import Request, Status
from hicache.engine.waiting import WaitingQueue
from radix import DEVICE

logger = logging.getLogger(__name__)


DECODE_RESERVE_TOKENS = 256  # decode room counted at admission (longer outputs may still preempt)
# with nothing else running, a request waits for its disk reads at most their estimated landing plus this share of
# the time recomputing them would take (see _wait_for_loads)
IDLE_WAIT_SLACK = 0.25

class Scheduler:
    """Owns the request queues and every page a request holds; see the module doc."""

    def __init__(self, controller: TierController, max_running: int, chunk_tokens: int, batch_tokens: int = 0,
                 admit_during_forward: bool = False):
        """batch_tokens: a step adds another request's prefill chunk only while its prefill tokens are fewer
        (0: no limit below chunk_tokens); see `_plan`. admit_during_forward: `after_forward` admits for the next
        step while the forward runs."""
        self.ctrl = controller
        self.admit_during_forward = admit_during_forward
        if admit_during_forward:
            logger.info("the next step's admissions run during each forward (scheduler.admit_during_forward)")
        self.page_size = controller.page_size
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens
        self.batch_tokens = batch_tokens or chunk_tokens
        # by arrival (preempted requests go back to their place), with what the cache does for them meanwhile
        self.waiting = WaitingQueue(controller, self._pages_needed, self._release, max_running, lambda: self.clock())
        self.loading: list[Request] = []
        self.running: list[Request] = []  # by admission order
        self.draining: list[LoadTicket] = []  # tickets given up while loading: released once their loads settle
        self._admissions = itertools.count()
        self._starved = False  # ran out of GPU pages: admit nothing new until a request leaves
        self.preemptions = 0
        self.clock = time.monotonic  # deadlines for disk reads (replaceable in tests)

    # ------------------------------------------------------------------ queues

    def add(self, req: Request) -> None:
        """Queue a new request."""
        self.waiting.add(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.loading or self.running or self.draining)

    def remove(self, req: Request) -> None:
        """Take a request out of the scheduler (finish or abort), committing and freeing its pages."""
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.LOADING:
            self.loading.remove(req)
            self._release(req.ticket)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            self._commit(req)
            self._drop_pages(req)
        req.status = Status.FINISHED
        self._starved = False

    # ------------------------------------------------------------------ one step

    @contextmanager
    def step(self) -> Iterator[list[tuple[Request, int]]]:
        """One engine step: apply finished I/O, admit, prefetch and plan; yields the plan, (request, new tokens)
        pairs with their pages allocated. On exit the loads the step asked for start, and an engine with
        nothing to do lets the cache start deferred backups."""
        with self.ctrl.step():
            plan = self.schedule()
            yield plan
            if not plan and not self.has_work():
                self.ctrl.idle()

    def schedule(self) -> list[tuple[Request, int]]:
        """Admit and plan this step (inside `step`, which applied finished I/O first)."""
        self.settle()
        self._admit()
        self.waiting.prefetch()
        return self._plan()

    def before_forward(self, plan: Sequence[tuple[Request, int]]) -> list[Any]:
        """The plan's forward is about to be queued: returns the copies still bringing pages it reads, which the
        forward waits for on the GPU (layer by layer where they are layered: `tiers.layered_copy.layer_waits`);
        with admission during the forward, what is asked for until the step ends need not wait for that forward."""
        waits: dict[int, Any] = {}
        for req, _ in plan:
            if req.needs_stream_wait:  # its prefix was copied in from host or L3 on the copy stream
                waits.update((id(h), h) for h in self.ctrl.load_waits(req.ticket))
                req.needs_stream_wait = False
        if self.admit_during_forward or (self.waiting and self.ctrl.staging.enabled):
            self.ctrl.fence_forward()  # what is asked for during the forward does not wait for it (after_forward)
        return list(waits.values())

    def after_forward(self, plan: Sequence[tuple[Request, int]]) -> None:
        """The plan's forward is queued: admit for the next step while it runs (admit_during_forward), stage the
        queue's prefixes on the GPU, then start the loads held while scheduling and those copies. Staging here keeps
        its engine-thread work (matches, evictions, issuing copies) off the GPU's critical path: an admission that
        empties the step (its request waits for its load) is followed at once by the forward that reads it."""
        if self.admit_during_forward:
            self.admit_ahead(plan)
        self._stage()
        self.ctrl.launch_loads()

    def admit_ahead(self, plan: Sequence[tuple[Request, int]]) -> None:
        """While `plan`'s forward runs: apply finished I/O, admit and prefetch for the next step, so that this
        engine-thread work (tree lookups, evictions, asking for loads) overlaps the GPU instead of delaying the next
        forward. The planned tokens count as computed for the admission budget. `schedule` still admits whatever
        the step's commits and finished requests make room for."""
        self.ctrl.poll()
        self.settle()
        self._admit(sum(min(n, len(r.token_ids) - r.computed - 1) for r, n in plan))  # decodes: 0
        self.waiting.prefetch()

    def advance(self, plan: Sequence[tuple[Request, int]]) -> None:
        """After the forward: the planned tokens' KV is in the pages; commit the pages that filled."""
        for req, n in plan:
            req.computed += n
            gap = req.ticket.gap
            if gap is None:
                self._commit(req)
            elif req.computed == gap[1] * self.page_size:
                self._close_gap(req)

    def settle(self) -> None:
        """Move requests whose loads finished to RUNNING; retry failed loads; release drained tickets."""
        now = self.clock()
        for req in list(self.loading):
            if req.ticket.failed:  # an L3 read failed verification: the controller drops those pages
                self.loading.remove(req)
                failed, req.ticket = req.ticket, None
                self._release(failed)
                self._acquire(req, replaces=failed)
            elif req.ticket.prefix_usable():  # the whole prefix, or what precedes its gap (it may still stream in)
                self.loading.remove(req)
                self._start(req)
            elif now >= req.load_deadline and self._give_up_reads(req):
                self.loading.remove(req)
                self._start(req)
        for ticket in list(self.draining):
            if ticket.ready():
                self.draining.remove(ticket)
                self.ctrl.release(ticket)

    def drain(self) -> None:
        """Wait for the loads of tickets given up while loading, then release them (shutdown)."""
        self.ctrl.launch_loads()  # held loads (a step that failed after scheduling): drained tickets wait for them
        while self.draining:
            self.ctrl.poll()
            self.settle()
            if self.draining:
                time.sleep(0.001)

    # ------------------------------------------------------------------ what the engine reports

    def queue_lengths(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "loading": len(self.loading), "running": len(self.running)}

    def cache_gauges(self) -> dict[str, int]:
        """What the step log reads of the cache: GPU pages in use, and GPU pages freed while their copy to host
        was in flight (a counter)."""
        return self.ctrl.gauges()

    def cache_report(self) -> dict[str, Any]:
        """The cache's counters, tier usage and cost model (Engine.stats)."""
        return self.ctrl.report()

    def _release(self, ticket: LoadTicket) -> None:
        """Release a ticket, or keep its lock until its loads settle (their pages are being written)."""
        if ticket.ready():
            self.ctrl.release(ticket)
        else:
            self.draining.append(ticket)

    def _close_gap(self, req: Request) -> None:
        """req computed its gap: commit it, jump to the end of the prefix, wait for the tail if needed."""
        k, s = req.ticket.gap
        self.ctrl.commit_gap(req.ticket, req.token_ids, req.pages[k:s])
        req.gap_tokens += (s - k) * self.page_size
        req.pages = req.ticket.device_pages()  # [0, k) loaded, [k, s) computed, [s, n) loaded
        req.committed_pages = len(req.pages)
        req.computed = req.committed_pages * self.page_size
        req.needs_stream_wait = True  # the tail (and gap pages another request loaded) came by copy
        if req.ticket.failed or not req.ticket.usable():
            self.running.remove(req)
            self._wait_for_loads(req)

    def _pages_needed(self, req: Request) -> int:
        """GPU pages req will hold: its whole prompt (cached prefix loaded + the rest computed) and some
        decode room. Admission keeps the sum over admitted requests within the pool, so a prefix loaded
        from host or L3 is not cut short (and recomputed) for lack of GPU pages, and preemption stays rare."""
        decode = min(req.max_tokens - req.num_output, DECODE_RESERVE_TOKENS)
        return -(-(len(req.token_ids) + max(decode, 0)) // self.page_size)

    def _admit(self, in_flight: int = 0) -> None:
        """Admit waiting requests, oldest first, while the prefill backlog is under one step's budget and their
        pages fit the GPU pool; in_flight: tokens of the forward now running (computed, not yet advanced).

        The backlog is the running requests' prefill. A request waiting in LOADING for its prefix is not in it: the
        GPU cannot compute any of its tokens before the reads land, so counting them would leave the GPU idle
        behind a disk read while the queue holds work it could do (the H200's step logs showed such waits with
        seven requests queued). The request admitted meanwhile comes after it in the plan (oldest first) once its
        reads land; its pages still count against the pool."""
        if not self.waiting or len(self.running) + len(self.loading) >= self.max_running:
            return
        if self._starved and (self.running or self.loading):
            return
        admitted = self.running + self.loading
        # tokens left to prefill (a decoding request has none: its last token is computed as it decodes), newest
        # first: they are the ones prefilling, and a step's worth ends the count (called every step, over
        # max_running requests)
        backlog = -in_flight
        for r in reversed(self.running):
            backlog += max(0, len(r.token_ids) - r.computed - 1)
            if backlog >= self.chunk_tokens:
                return  # a step's worth of prefill is queued already
        reserved = sum(self._pages_needed(r) for r in admitted)
        capacity = self.ctrl.device.capacity_pages
        while self.waiting and len(self.running) + len(self.loading) < self.max_running:
            if backlog >= self.chunk_tokens or (self._starved and (self.running or self.loading)):
                break
            need = self._pages_needed(self.waiting.front)
            if (self.running or self.loading) and reserved + need > capacity:
                break  # wait for pages rather than thrash; a request alone is always admitted
            self.waiting.unstage_from_back(capacity - reserved - need)  # stages behind it leave it its pages
            req = self.waiting.pop()
            req.admitted_seq = next(self._admissions)
            self._acquire(req)
            backlog += len(req.token_ids) - req.computed - 1
            reserved += need

    def _stage(self) -> None:
        """Stage the waiting requests' prefixes in the GPU pages the admitted requests do not need
        (hicache/engine/waiting.py)."""
        if self.waiting and self.ctrl.staging.enabled:
            admitted = self.running + self.loading
            self.waiting.stage(self.ctrl.device.capacity_pages - sum(self._pages_needed(r) for r in admitted))

    def _acquire(self, req: Request, replaces: LoadTicket | None = None) -> None:
        """Claim the cached prefix (at least one token is left to compute, for the logits); `replaces`: the
        ticket whose load failed, which this one retries."""
        ps = self.page_size
        ticket = self.ctrl.acquire(req.token_ids, max_pages=(len(req.token_ids) - 1) // ps, overlap=True,
                                   replaces=replaces, namespace=req.namespace, busy=bool(self.running))
        req.ticket = ticket
        self.waiting.release_holds(req)  # the ticket holds what its prefetch and stage held
        req.pages = ticket.prefix_pages()  # the gap's pages come from alloc_device as it is computed
        req.committed_pages = len(req.pages)
        req.computed = req.committed_pages * ps  # tokens [0, computed) are cached
        req.needs_stream_wait = any(tier != DEVICE for tier in ticket.hit_pages)
        if req.cached_tokens is None or req.status is Status.LOADING:  # first admission (or its retry)
            self._note_hits(req)
        if ticket.prefix_usable() and not ticket.failed:
            self._start(req)
        else:
            self._wait_for_loads(req, admitted=True)

    def _wait_for_loads(self, req: Request, admitted: bool = False) -> None:
        """req waits in LOADING until its ticket's loads land (settle moves it back to RUNNING), or until its
        deadline for disk reads: as long as the GPU would take to get to it and recompute those pages.

        Waiting costs the GPU nothing while it has other requests' prefill queued, and every page the disk delivers
        is a page it does not compute; past the deadline the request would have had its first token sooner by
        computing, so it takes what has landed and computes the rest (`_give_up_reads`). With nothing else
        running, it waits only for the reads' estimated landing plus IDLE_WAIT_SLACK of their recompute time. Just
        `admitted`, it gives them up at once where the disk queue's estimate already says they land after the
        deadline. All of this is load mode auto's: mode "always" loads every hit and waits for it however long."""
        req.status = Status.LOADING
        self.loading.append(req)
        cost = self.ctrl.cost
        if cost.mode != "auto":  # "always" waits for every hit, as it was asked to
            req.load_deadline = float("inf")
            return
        recompute, landing = self.ctrl.pending_reads(req.ticket)
        wait = recompute
        if wait != float("inf"):
            backlog = self.prefill_backlog_seconds()
            wait += backlog
            if admitted and landing > wait and self._give_up_reads(req):
                # reads it rides (a prefetch) are further behind than the GPU would take: compute at once
                self.loading.remove(req)
                self._start(req)
                return
            if backlog == 0:
                # nothing else runs: every second of waiting is a second of idle GPU, so a read later than its
                # estimate by a quarter of the recompute time is given up (waiting the whole recompute time and then
                # recomputing would cost twice that)
                wait = min(wait, max(landing, 0.0) + IDLE_WAIT_SLACK * recompute)
        req.load_deadline = self.clock() + wait

    def prefill_backlog_seconds(self) -> float:
        """Seconds of prefill the running requests still have to do, by the cost model: how long the GPU takes to
        get to a request that waits for its reads."""
        cost = self.ctrl.cost
        return sum(cost.prefill_seconds(r.computed, len(r.token_ids)) for r in self.running)

    def _give_up_reads(self, req: Request) -> bool:
        """req passed its deadline: stop waiting for its disk reads (they land in host memory for later) and run
        with the prefix that is on the GPU; False if there was nothing to give up."""
        residual = self.ctrl.give_up_reads(req.ticket)
        if residual is None:
            return False
        self.draining.append(residual)  # released once the transfers under the old end of the prefix settle
        ticket = req.ticket
        req.pages = ticket.prefix_pages()
        req.committed_pages = len(req.pages)
        req.computed = req.committed_pages * self.page_size
        req.needs_stream_wait = True
        self._note_hits(req)
        logger.debug("%s gave up waiting for disk reads: computes from token %d", req.request_id, req.computed)
        return True

    def _note_hits(self, req: Request) -> None:
        """The cached tokens per tier that req's response reports, from its ticket."""
        ps = self.page_size
        req.cached_tokens = {tier: pages * ps for tier, pages in req.ticket.hit_pages.items()}
        if req.gap_tokens and DEVICE in req.cached_tokens:  # its own gap, committed before a failed load
            req.cached_tokens[DEVICE] = max(0, req.cached_tokens[DEVICE] - req.gap_tokens)

    def _start(self, req: Request) -> None:
        if not req.ticket.prefix_ready():  # pages still streaming in, its own loads or another request's
            req.needs_stream_wait = True
        req.status = Status.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.admitted_seq)

    def _plan(self) -> list[tuple[Request, int]]:
        plan: dict[Request, int] = {}
        # (each loop first picks its requests by what only its own request's turn changes: this runs every step,
        # over up to max_running requests, and the picking is most of it)
        for req in [r for r in self.running if r.awaiting_loads]:
            self._check_loads(req)
        for req in [r for r in self.running if not r.awaiting_loads and len(r.token_ids) - r.computed == 1]:
            # decodes: one token each, oldest first (an older one's _reserve may preempt it)
            if req.status is Status.RUNNING and self._reserve(req, 1, plan):
                plan[req] = 1
        # prefill chunks, oldest first, within the step's budget. Once the step holds batch_tokens prefill
        # tokens it takes no further request (a long prompt's chunk still fills the budget): a burst of short
        # prompts then gets first tokens in turn rather than all at the end of one long step, for some throughput
        # (on the H200 it did not pay on the multi-turn benchmark; off by default)
        budget = self.chunk_tokens - len(plan)
        prefill = 0
        for req in [r for r in self.running if r not in plan and not r.awaiting_loads]:
            if req.status is not Status.RUNNING:  # preempted by an older one's _reserve (no ticket)
                continue
            gap = req.ticket.gap
            remaining = (gap[1] * self.page_size if gap else len(req.token_ids)) - req.computed
            if remaining <= (0 if gap else 1):
                continue
            if budget <= 0 or prefill >= self.batch_tokens:
                break
            n = min(remaining, budget)
            if self._reserve(req, n, plan):
                plan[req] = n
                budget -= n
                prefill += n
            elif req.status is Status.RUNNING:
                break  # stalled for pages: newer requests would not get any either
        return list(plan.items())

    def _check_loads(self, req: Request) -> None:
        """A running request whose pages are another request's loads: go on once they land, start over
        (preempted: its re-admission recomputes what failed) if one failed."""
        if req.ticket.failed:
            req.awaiting_loads = False
            self.preempt(req)
        elif req.ticket.usable():
            req.awaiting_loads = False
            req.needs_stream_wait = True  # the copies ran (or still run, layer by layer) on the copy stream

    def _reserve(self, req: Request, n: int, plan: dict[Request, int]) -> bool:
        """Give req GPU pages for n more tokens, preempting newer requests if needed; False if it can't run."""
        ps = self.page_size
        need = -(-(req.computed + n) // ps) - len(req.pages)
        if need <= 0:
            return True
        while True:
            pages = self.ctrl.alloc_device(need)
            if pages is not None:
                req.pages.extend(pages)
                return True
            if self.waiting.unstage_all():
                continue  # queued requests' stages come second to running requests' pages
            self._starved = True
            newest = self.running[-1]
            if newest is req:
                if len(self.running) > 1:  # older requests will finish and free pages; let them
                    self.preempt(req)
                return False  # alone (pages held by loads or L3 writes in flight): wait a step
            self.preempt(newest)
            plan.pop(newest, None)

    # ------------------------------------------------------------------ pages

    def preempt(self, req: Request) -> None:
        """Send a running request back to the waiting queue, keeping its full pages cached."""
        logger.debug("preempting %s at %d tokens", req.request_id, req.computed)
        self.running.remove(req)
        self._commit(req)
        self._drop_pages(req)
        req.status = Status.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.add(req)

    def _commit(self, req: Request) -> None:
        """Insert req's newly filled pages into the tree; adopt the canonical page ids it returns.

        With a gap still open (req is being stopped) the gap pages filled so far are committed.
        """
        full = req.computed // self.page_size
        if full <= req.committed_pages:
            return
        if req.ticket.gap is not None:  # pages [k, full) of the gap
            k = req.committed_pages
            req.pages[k:full] = self.ctrl.commit_gap(req.ticket, req.token_ids, req.pages[k:full])
        else:
            canonical = self.ctrl.commit(req.ticket, req.token_ids[: full * self.page_size], req.pages[:full])
            if canonical != req.pages[:full] and not req.ticket.ready():
                # another request's copy of these pages won, and it is still loading: wait for it
                req.awaiting_loads = True
            req.pages[:full] = canonical
        req.committed_pages = full

    def _drop_pages(self, req: Request) -> None:
        """Release the ticket and free the private pages (the partial page and any reserved ahead)."""
        self._release(req.ticket)
        self.ctrl.free_device(req.pages[req.committed_pages :])
        req.ticket = None
        req.pages = []
        req.computed = req.committed_pages = 0
