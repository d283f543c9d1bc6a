"""The queue of requests waiting for admission, and what the cache does for them meanwhile.

A queued request holds no GPU pages of its own, but its time in the queue is time its cached prefix can travel:
- prefetch: its disk-only pages are read into host memory (`TierController.prefetch`), so that at admission they
  load from host;
- staging: its host pages are copied onto the GPU pages nobody else needs (controller/staging.py), so that at
  admission they are there.

Both act for the front of the queue first: those are the next to be admitted. The scheduler owns admission and
says how many GPU pages are free of the admitted requests' needs (`stage`); the queue gives those pages to its
front requests in order, each up to its own need, so that a stage never holds pages a request ahead of it needs.
Engine thread only.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from controller import LoadTicket, TierController
from hicache.engine.request import Request

# a queued request's prefix is matched again this often for prefetch: pages that were in host memory when it
# arrived (nothing to read then) may have left for the disk while it waits
PREFETCH_RECHECK_S = 0.25
# only the next requests to be admitted, at most this many, ask again: those further back ask once they come near
# (a queue of thousands would otherwise cost a prefix match per request every PREFETCH_RECHECK_S)
PREFETCH_RECHECK_FRONT = 8
# at most this many requests at the front of the queue stage their prefix on the GPU
STAGE_FRONT = 8


class WaitingQueue:
    """Requests waiting for admission, by arrival (a preempted request goes back to its place), with their
    prefetch holds and GPU stages (see the module doc)."""

    def __init__(self, ctrl: TierController, pages_needed: Callable[[Request], int],
                 release: Callable[[LoadTicket], None], max_running: int, clock: Callable[[], float]):
        self.ctrl = ctrl
        self.pages_needed = pages_needed  # GPU pages a request holds once admitted (Scheduler._pages_needed)
        self.release = release  # gives a ticket back once its copies have landed (Scheduler._release)
        self.max_running = max_running
        self.clock = clock
        self._queue: list[Request] = []
        self.fresh = 0  # requests that have not asked for a prefetch yet
        self.staged = 0  # requests holding a stage

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __contains__(self, req: object) -> bool:
        return req in self._queue

    @property
    def front(self) -> Request:
        """The next request to be admitted."""
        return self._queue[0]

    def add(self, req: Request) -> None:
        """Queue a request in its place by arrival."""
        bisect.insort(self._queue, req, key=lambda r: r.arrival)
        self.fresh += not req.prefetched

    def pop(self) -> Request:
        """Take the front request out for admission. Its prefetch hold and stage stay until its ticket holds what
        they did (`release_holds`)."""
        req = self._queue.pop(0)
        self.fresh -= not req.prefetched
        return req

    def remove(self, req: Request) -> None:
        """Take a request out of the queue (finished or aborted), giving back what the cache holds for it."""
        self._queue.remove(req)
        self.fresh -= not req.prefetched
        self.release_holds(req)

    def release_holds(self, req: Request) -> None:
        """Give back req's prefetch hold and stage (it was admitted, or left the queue)."""
        if req.prefetch_hold is not None:
            self.ctrl.release_prefetch(req.prefetch_hold)
            req.prefetch_hold = None
        self._unstage(req)

    # ------------------------------------------------------------------ prefetch

    def prefetch(self) -> None:
        """Send queued requests' disk-only prefix pages towards host memory, front of the queue first.

        A request asks once when it first waits. One whose prefetch stopped for lack of host room
        (cache.load_policy.prefetch_host_share) asks again on later steps, going on where it stopped, and the requests
        behind it wait their turn: room that admissions free goes to the next request to be admitted, not to whoever
        arrives next. The next PREFETCH_RECHECK_FRONT requests to be admitted also ask again every PREFETCH_RECHECK_S:
        their pages that were in memory when they arrived may have gone to disk since. Those further back ask again
        once they come near the front, so a long queue costs a step a match per request that is new or near
        admission, not a match per request queued.
        """
        if not self.ctrl.loads.prefetch_enabled:
            return
        now = self.clock()
        front = min(self.max_running, PREFETCH_RECHECK_FRONT)
        for i, req in enumerate(self._queue):
            hold = req.prefetch_hold
            if req.prefetched and (hold is None or not hold.short):
                if i >= front and self.fresh == 0:
                    break  # every request behind has asked, and none is near admission
                if i >= front or now - req.prefetched_at < PREFETCH_RECHECK_S:
                    continue
            if not req.prefetched:
                req.prefetched = True
                self.fresh -= 1
            req.prefetched_at = now
            limit = (len(req.token_ids) - 1) // self.ctrl.page_size
            req.prefetch_hold = self.ctrl.prefetch(req.token_ids, max_pages=limit, hold=hold, namespace=req.namespace)
            if req.prefetch_hold.short:
                break  # no room left: the requests behind it would find none either

    # ------------------------------------------------------------------ staging

    def stage(self, free: int) -> None:
        """Stage the front requests' host-resident prefixes on the GPU, within `free` GPU pages (the pool less what
        the admitted requests need): each, in queue order, gets what the requests ahead of it leave, up to its own
        need. A stage that no longer fits its share (a preempted request went back ahead of it) is given back.

        A request asks again only when its share has grown since it last asked (a running request finished) or
        every PREFETCH_RECHECK_S (its pages may have reached host memory since): a long prompt's match costs the
        engine thread a millisecond or so."""
        if not self.ctrl.staging.enabled:
            return
        now = self.clock()
        staged = self.staged
        for i, req in enumerate(self._queue):
            if free <= 0 or i >= STAGE_FRONT:
                if not staged:
                    break  # no stage behind: nothing to give back
                staged -= req.stage is not None
                self._unstage(req)
                continue
            staged -= req.stage is not None
            need = self.pages_needed(req)
            share = min(free, need)
            if req.stage_pages > share:
                self._unstage(req)
            if req.stage_pages < share and (share > req.stage_share or now - req.staged_at >= PREFETCH_RECHECK_S):
                limit = (len(req.token_ids) - 1) // self.ctrl.page_size
                stage = self.ctrl.staging.stage(req.token_ids, limit, share, req.namespace)
                if stage is not None:
                    self._unstage(req)  # the new stage locks the old one's pages too
                    req.stage, req.stage_pages = stage
                    self.staged += 1
                req.stage_share, req.staged_at = share, now
            free -= need

    def unstage_from_back(self, room: int) -> None:
        """Give back stages, from the back of the queue, until those behind the front lock at most `room` pages: the
        front request is being admitted and needs the rest. (Called at every admission: with no stage held it
        costs nothing, however long the queue.)"""
        if not self.staged:
            return
        behind = self._queue[1:]
        held = sum(r.stage_pages for r in behind)
        for req in reversed(behind):
            if held <= room:
                return
            held -= req.stage_pages
            self._unstage(req)

    def unstage_all(self) -> bool:
        """Give back every stage (a running request needs GPU pages beyond its reservation); False if none."""
        if not self.staged:
            return False
        for req in self._queue:
            self._unstage(req)
        return True

    def _unstage(self, req: Request) -> None:
        if req.stage is not None:
            self.release(req.stage)
            req.stage, req.stage_pages, req.stage_share = None, 0, 0
            self.staged -= 1
