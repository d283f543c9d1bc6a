"""Staging a queued request's host-resident prefix on the GPU (controller/staging.py), and how the waiting queue
shares the free GPU pages among its front requests (hicache/engine/waiting.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from test_controller import LAYOUT, Harness, page_value, seq

from controller import CostModel
from hicache.engine.params import SamplingParams
from hicache.engine.request import Request
from hicache.engine.waiting import STAGE_FRONT, WaitingQueue
from radix import DEFAULT_NAMESPACE, DEVICE, HOST

PS = LAYOUT.page_size


def always() -> CostModel:
    return CostModel(PS, LAYOUT.page_bytes, mode="always")


def tiers_of(h: Harness, tokens: tuple[int, ...]) -> dict[str, int]:
    """Matched pages of tokens by their fastest tier."""
    out: dict[str, int] = {}
    for node, tier in h.ctrl.match(tokens, reference=False).segments:
        out[tier] = out.get(tier, 0) + node.num_pages
    return out


def on_host_only(pages: int) -> tuple[Harness, tuple[int, ...]]:
    """A harness whose GPU (4 pages) holds none of a `pages`-page prompt's prefix and whose host holds all of it."""
    h = Harness(device=4, host=12, disk=0, cost=always())
    a = tuple(seq(1, pages))
    h.run(list(a))
    h.run(seq(2, 4))  # pushes a off the GPU (its host copies stay)
    assert tiers_of(h, a) == {HOST: pages}
    return h, a


def test_a_stage_copies_host_pages_onto_the_gpu_and_admission_counts_them_as_host_hits():
    h, a = on_host_only(3)
    staged = h.ctrl.staging.stage(a, max_pages=3, budget=2, namespace=DEFAULT_NAMESPACE)
    assert staged is not None
    ticket, locked = staged
    assert locked == 2 and h.ctrl.stats.staged_pages == 2
    h.ctrl.wait_ticket(ticket)
    assert tiers_of(h, a) == {DEVICE: 2, HOST: 1}  # the budget's first two pages
    for i, p in enumerate(ticket.device_pages()):
        assert torch.all(h.dev.kv[:, :, p] == page_value(a, i))
    assert all(node.lock_ref > 0 for node in ticket.nodes)  # locked until admission
    assert h.run(list(a)) == {HOST: 3}  # the two staged pages are host hits, as is the one loaded at admission
    h.ctrl.release(ticket)
    assert h.run(list(a)) == {DEVICE: 3}  # served once: now GPU hits
    h.ctrl.check_integrity()
    assert all(node.lock_ref == 0 for node in h.ctrl.tree.nodes())


def test_a_split_staged_node_keeps_both_parts_host_hits_and_eviction_forgets_the_mark():
    h, a = on_host_only(3)
    ticket, _ = h.ctrl.staging.stage(a, max_pages=3, budget=3, namespace=DEFAULT_NAMESPACE)
    h.ctrl.wait_ticket(ticket)
    h.ctrl.release(ticket)
    first = h.ctrl.acquire(a[:2 * PS + 1], max_pages=2)  # splits the staged node after its second page
    assert first.hit_pages == {HOST: 2}
    h.ctrl.release(first)
    rest = h.ctrl.acquire(a, max_pages=3)
    assert rest.hit_pages == {DEVICE: 2, HOST: 1}  # the lower part kept its mark
    h.ctrl.release(rest)
    h.run(seq(3, 4))  # evicts a from the GPU: its staged mark goes with its GPU pages
    assert not h.ctrl.transfers.staged
    assert h.run(list(a)) == {HOST: 3}


def test_nothing_to_stage_on_the_gpu_only_on_disk_or_without_budget():
    h, a = on_host_only(3)
    assert h.ctrl.staging.stage(a, max_pages=3, budget=0, namespace=DEFAULT_NAMESPACE) is None
    assert h.ctrl.staging.stage(tuple(seq(9, 3)), max_pages=3, budget=3, namespace=DEFAULT_NAMESPACE) is None
    h.run(list(a))  # on the GPU again
    assert h.ctrl.staging.stage(a, max_pages=3, budget=3, namespace=DEFAULT_NAMESPACE) is None
    assert h.ctrl.stats.staged_pages == 0
    never = Harness(device=4, host=12, disk=0, cost=CostModel(PS, LAYOUT.page_bytes, mode="never"))
    assert not never.ctrl.staging.enabled
    assert not Harness(device=4, host=0, disk=0).ctrl.staging.enabled


class Stages:
    """The controller as the queue's staging sees it: records each ask's budget and grants it whole."""

    page_size = 4

    def __init__(self) -> None:
        self.loads = SimpleNamespace(prefetch_enabled=False)
        self.staging = SimpleNamespace(enabled=True, stage=self._stage)
        self.asked: list[tuple[str, int]] = []

    def _stage(self, tokens, max_pages, budget, namespace):
        self.asked.append((tokens[0], budget))
        return SimpleNamespace(name=tokens[0]), budget


def queue_of(ctrl: Stages, released: list[str], needs: dict[str, int]) -> WaitingQueue:
    return WaitingQueue(ctrl, lambda r: needs[r.request_id], lambda t: released.append(t.name), 8, lambda: 0.0)


def request(name: str, arrival: float) -> Request:
    return Request(name, 40, [name] * 40, SamplingParams(), 4, arrival=arrival)


def test_the_front_requests_share_the_free_pages_in_queue_order_and_a_request_ahead_takes_them_back():
    ctrl, released = Stages(), []
    needs = {"r1": 6, "r2": 6, "r3": 6, "r0": 8}
    queue = queue_of(ctrl, released, needs)
    r1, r2, r3 = request("r1", 1.0), request("r2", 2.0), request("r3", 3.0)
    for r in (r1, r2, r3):
        queue.add(r)
    queue.stage(10)
    assert ctrl.asked == [("r1", 6), ("r2", 4)]  # r2 gets what r1's need leaves; r3 none
    assert (r1.stage_pages, r2.stage_pages, r3.stage) == (6, 4, None) and queue.staged == 2
    ctrl.asked.clear()
    queue.stage(10)
    assert ctrl.asked == [] and released == []  # nothing grew, no recheck due: nobody asks again
    queue.add(r0 := request("r0", 0.0))  # e.g. preempted: back at the front
    queue.stage(10)
    assert ctrl.asked == [("r0", 8), ("r1", 2)]  # r1's share shrank to 2: its stage goes, and it asks for 2
    assert released == ["r1", "r2"] and r2.stage is None and r1.stage_pages == 2 and r0.stage_pages == 8
    queue.unstage_from_back(0)  # r0 is admitted and needs every page the others hold
    assert released == ["r1", "r2", "r1"] and queue.staged == 1
    assert queue.pop() is r0
    queue.release_holds(r0)
    assert released[-1] == "r0" and queue.staged == 0


def test_only_the_front_stages_and_a_request_leaving_the_queue_gives_its_stage_back():
    ctrl, released = Stages(), []
    names = [f"q{i}" for i in range(STAGE_FRONT + 2)]
    queue = queue_of(ctrl, released, dict.fromkeys(names, 1))
    reqs = [request(n, float(i)) for i, n in enumerate(names)]
    for r in reqs:
        queue.add(r)
    queue.stage(100)
    assert [name for name, _ in ctrl.asked] == names[:STAGE_FRONT]
    queue.remove(reqs[1])
    assert released == ["q1"] and queue.staged == STAGE_FRONT - 1
    assert queue.unstage_all() and queue.staged == 0 and not queue.unstage_all()
