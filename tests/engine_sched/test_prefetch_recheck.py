"""Which queued requests the scheduler asks to prefetch (WaitingQueue.prefetch): every new one at once, and again
every PREFETCH_RECHECK_S only the next PREFETCH_RECHECK_FRONT to be admitted, so a long queue costs a step a prefix
match per request that is new or near admission."""

from __future__ import annotations

from types import SimpleNamespace

from hicache.engine.params import SamplingParams
from hicache.engine.request import Request
from hicache.engine.scheduler import Scheduler
from hicache.engine.waiting import PREFETCH_RECHECK_FRONT, PREFETCH_RECHECK_S


class Prefetches:
    """The controller as the queue's prefetch sees it: records who asked, and answers with a hold that is never short
    (and takes it back when its request leaves the queue)."""

    page_size = 4

    def __init__(self) -> None:
        self.loads = SimpleNamespace(prefetch_enabled=True)
        self.asked: list[str] = []

    def prefetch(self, tokens, max_pages=None, hold=None, namespace=None):
        self.asked.append(tokens[0])
        return SimpleNamespace(short=False)

    def release_prefetch(self, hold) -> None:
        pass


def request(name: str, arrival: float) -> Request:
    return Request(name, 8, [name] * 8, SamplingParams(), 4, arrival=arrival)


def test_new_requests_ask_at_once_and_only_the_front_asks_again() -> None:
    ctrl = Prefetches()
    sched = Scheduler(ctrl, max_running=64, chunk_tokens=64)
    now = [0.0]
    sched.clock = lambda: now[0]
    queue = [request(f"r{i}", float(i)) for i in range(PREFETCH_RECHECK_FRONT + 4)]
    for req in queue:
        sched.add(req)
    sched.waiting.prefetch()
    assert ctrl.asked == [r.request_id for r in queue]  # every new request, in queue order
    ctrl.asked.clear()
    sched.waiting.prefetch()
    assert ctrl.asked == []  # nobody new, no recheck due
    now[0] = PREFETCH_RECHECK_S
    sched.add(late := request("late", 100.0))
    sched.waiting.prefetch()
    front = [r.request_id for r in queue[:PREFETCH_RECHECK_FRONT]]
    assert ctrl.asked == [*front, "late"]  # the front rechecks; the rest of the queue does not; the new one asks
    ctrl.asked.clear()
    sched.remove(queue[0])  # the queue moves up: the next one enters the front
    now[0] = 2 * PREFETCH_RECHECK_S
    sched.waiting.prefetch()
    assert ctrl.asked == [r.request_id for r in queue[1:PREFETCH_RECHECK_FRONT + 1]]
    assert sched.waiting.fresh == 0 and late.prefetched
