"""Compute the prefix's first pages while loading its last: the cost model's three-way plan, and the
controller's gap tickets (loads of [0, k) and [s, n), the caller's pages adopted for [k, s), failures)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from memory_l3 import MemoryL3
from test_controller import LAYOUT, Harness, page_value, seq

from controller import CostModel
from controller.cost import LoadPlan
from radix import DEVICE, DISK, HOST, page_keys

PS = LAYOUT.page_size


def unit_cost(overlap: bool = True, mode: str = "auto") -> CostModel:
    """1 s to compute a page, 0.25 s to load one from host, 3 s from disk (page_size 1, 3 bytes a page)."""
    return CostModel(1, 3, mode, 1.0, 12.0, 1.0, adaptive=False, overlap=overlap)


def test_plan_balances_compute_and_load():
    cost = unit_cost()
    runs = [(DEVICE, 2), (HOST, 4), (DISK, 12)]
    # load [0, 6) (host: 1 s), then compute [6, 15) (9 s) while [15, 18) loads from disk (9 s)
    assert cost.plan(runs) == LoadPlan(6, 15, 18)
    assert cost.finish_seconds(runs, LoadPlan(6, 15, 18)) == 10.0
    assert cost.finish_seconds(runs, LoadPlan(6, 6, 6)) == 13.0  # recompute all disk pages
    assert cost.finish_seconds(runs, LoadPlan(18, 18, 18)) == 36.0  # load all of them
    assert cost.finish_seconds(runs, LoadPlan(6, 14, 18)) == 12.0  # one page short: the load finishes last
    assert unit_cost(overlap=False).plan(runs) == LoadPlan(6, 6, 6)  # the one-cut plan


def test_plan_special_cases():
    cost = unit_cost()
    assert cost.plan([]) == LoadPlan(0, 0, 0)
    assert cost.plan([(DISK, 1)]) == LoadPlan(0, 0, 0)  # loading one page takes longer than computing it
    assert cost.plan([(DISK, 4)]) == LoadPlan(0, 3, 4)  # 3 s either way, against 4 s of compute
    assert cost.plan([(DEVICE, 3), (HOST, 2)]) == LoadPlan(5, 5, 5)  # host pages: loading them is cheaper
    # a disk faster than compute (0.5 s): computing a third while two thirds load still beats loading all
    fast = dataclasses.replace(cost, disk_to_device_bytes_per_s=6.0)
    assert fast.plan([(DISK, 30)]) == LoadPlan(0, 10, 30)
    assert fast.finish_seconds([(DISK, 30)], LoadPlan(0, 10, 30)) == 10.0
    # a disk so slow that even one page loads slower than the whole run computes: recompute
    assert dataclasses.replace(cost, disk_to_device_bytes_per_s=0.1).plan([(DISK, 8)]) == LoadPlan(0, 0, 0)


def test_plan_does_not_depend_on_how_a_tier_is_split_into_nodes():
    """A prefix of one tier is one run: the same plan for 1 node of 12 pages as for 12 of 1, or 6 of 2."""
    cost = unit_cost()
    whole = [(DEVICE, 2), (HOST, 4), (DISK, 12)]
    split = [(DEVICE, 1), (DEVICE, 1)] + [(HOST, 1)] * 4 + [(DISK, 2)] * 6
    assert cost.plan(split) == cost.plan(whole) == LoadPlan(6, 15, 18)
    many = [(HOST, 1)] * 400 + [(DISK, 1)] * 400  # a long session's prefix, one node a turn
    assert cost.plan(many) == cost.plan([(HOST, 400), (DISK, 400)])


def test_plan_needs_auto_mode_and_known_costs():
    runs = [(DEVICE, 1), (DISK, 4)]
    assert unit_cost(mode="never").plan(runs) == LoadPlan(1, 1, 1)
    assert unit_cost(mode="always").plan(runs) == LoadPlan(5, 5, 5)
    unknown = dataclasses.replace(unit_cost(), disk_to_device_bytes_per_s=None)  # loading counts as free
    assert unknown.plan(runs) == LoadPlan(5, 5, 5)
    assert dataclasses.replace(unit_cost(), prefill_tokens_per_s=None).plan(runs) == LoadPlan(5, 5, 5)
    # an unknown host bandwidth does not matter when no page is on host
    assert dataclasses.replace(unit_cost(), host_to_device_bytes_per_s=None).plan(runs) == LoadPlan(1, 4, 5)


# ---------------------------------------------------------------------- controller

def slow_disk_cost() -> CostModel:
    """For LAYOUT: 1 s to compute a page, 3 s to load one from disk, 0.25 s from host."""
    pb = LAYOUT.page_bytes
    return CostModel(PS, pb, "auto", float(PS), pb * 4.0, pb / 3.0, adaptive=False, overlap=True)


def restarted(device: int = 12, host: int = 12, bad_page: int | None = None) -> tuple[Harness, tuple[int, ...]]:
    """A controller whose tree has seq(1, 8)'s first 2 pages on GPU and the other 6 only on disk."""
    l3 = MemoryL3(64, LAYOUT.page_bytes)
    Harness(device=12, host=12, l3=l3).run(seq(1, 8))
    tokens = tuple(seq(1, 8))
    h = Harness(device=device, host=host, l3=l3, cost=CostModel(PS, LAYOUT.page_bytes, "always"))
    assert h.run(list(tokens[: 2 * PS + 1])) == {DISK: 2}  # a fresh process loads the first 2 pages
    h.ctrl.cost = slow_disk_cost()
    if bad_page is not None:
        l3.corrupt = {page_keys(h.ctrl.tree.namespace, tokens[: 8 * PS], PS)[bad_page]}
    return h, tokens


def check_pages(h: Harness, tokens: tuple[int, ...], first: int, pages: list[int]) -> None:
    for i, p in enumerate(pages):
        assert torch.all(h.dev.kv[:, :, p] == page_value(tokens, first + i)), f"page {first + i} has wrong bytes"


def compute(h: Harness, tokens: tuple[int, ...], first: int, n: int) -> list[int]:
    """The engine stand-in: pages [first, first + n) computed into new private GPU pages."""
    pages = h.ctrl.alloc_device(n)
    for i, p in enumerate(pages):
        h.dev.kv[:, :, p] = page_value(tokens, first + i)
    return pages


def test_gap_ticket_computes_first_pages_while_last_load():
    h, tokens = restarted()
    ctrl = h.ctrl
    before = ctrl.stats.recomputed_tokens
    ticket = ctrl.acquire(tokens, max_pages=8, overlap=True)
    assert ticket.gap == (2, 7) and ticket.num_pages == 8
    assert ticket.hit_pages == {DEVICE: 2, DISK: 1}  # the gap counts as recomputed
    assert ctrl.stats.recomputed_tokens - before == 5 * PS
    gap_nodes = ticket.part(2, 7)
    assert gap_nodes and all(not n.on_device and n.on_disk for n in gap_nodes)
    assert all(n.on_device for n in ticket.part(7, 8))  # the tail has GPU pages, loading
    with pytest.raises(ValueError, match="gap"):
        ticket.device_pages()
    ctrl.check_integrity()
    assert ticket.prefix_ready()
    check_pages(h, tokens, 0, ticket.prefix_pages())
    gap = compute(h, tokens, 2, 5)  # while the tail loads
    ctrl.check_integrity()
    assert ctrl.wait_ticket(ticket) and not ticket.failed
    check_pages(h, tokens, 7, [p for n in ticket.part(ticket.gap[1], ticket.num_pages) for p in n.device_pages])
    with pytest.raises(ValueError, match="commit_gap"):
        ctrl.commit(ticket, tokens, gap)
    assert ctrl.commit_gap(ticket, tokens, gap) == gap  # adopted as the gap nodes' GPU copy
    assert ticket.gap is None and all(n.on_device for n in ticket.nodes)
    ctrl.check_integrity()
    pages = ticket.device_pages()
    assert pages[2:7] == gap
    check_pages(h, tokens, 0, pages)
    assert ctrl.commit(ticket, tokens, pages) == pages
    ctrl.release(ticket)
    ctrl.check_integrity()
    h.check_all_bytes()
    assert h.run(list(tokens)) == {DEVICE: 8}
    h.check_all_bytes()


def test_gap_nodes_loaded_or_committed_by_another_request():
    h, tokens = restarted(device=16)
    ctrl = h.ctrl
    a = ctrl.acquire(tokens, max_pages=8, overlap=True)
    # for b page 7 is on GPU already (loading for a): it computes [2, 6) and loads page 6, in a's gap
    b = ctrl.acquire(tokens, max_pages=8, overlap=True)
    assert a.gap == (2, 7) and b.gap == (2, 6) and b.hit_pages == {DEVICE: 3, DISK: 1}
    gap_a, gap_b = compute(h, tokens, 2, 5), compute(h, tokens, 2, 4)
    ctrl.check_integrity()
    assert ctrl.commit_gap(b, tokens, gap_b) == gap_b
    page_6 = b.part(6, 7)[0].device_pages[0] if b.gap else b.device_pages()[6]
    assert ctrl.commit_gap(a, tokens, gap_a) == gap_b + [page_6]  # the tree's pages win; a's are freed
    assert not set(gap_a) & ctrl.commits.private and not set(gap_a) & set(ctrl.tree.owned_pages(DEVICE))
    ctrl.check_integrity()
    for t in (a, b):
        assert ctrl.wait_ticket(t) and not t.failed
        check_pages(h, tokens, 0, t.device_pages())
        ctrl.release(t)
    ctrl.check_integrity()
    h.check_all_bytes()


def test_failed_tail_keeps_the_committed_gap():
    h, tokens = restarted(bad_page=7)
    ctrl = h.ctrl
    ticket = ctrl.acquire(tokens, max_pages=8, overlap=True)
    assert ticket.gap == (2, 7)
    gap = compute(h, tokens, 2, 5)
    ctrl.wait_ticket(ticket)
    assert ticket.failed
    ctrl.commit_gap(ticket, tokens, gap)  # commit what was computed, then retry
    ctrl.release(ticket)
    ctrl.check_integrity()
    retry = ctrl.acquire(tokens, max_pages=8, overlap=True)
    assert retry.gap is None and retry.hit_pages == {DEVICE: 7}  # the failed page is gone: recompute it
    check_pages(h, tokens, 0, retry.device_pages())
    ctrl.release(retry)
    ctrl.check_integrity()
    h.check_all_bytes()


def test_partial_gap_commit():
    h, tokens = restarted()
    ctrl = h.ctrl
    ticket = ctrl.acquire(tokens, max_pages=8, overlap=True)
    gap = compute(h, tokens, 2, 2)  # stopped (preempted, aborted) after two pages of the gap
    assert ctrl.commit_gap(ticket, tokens, gap) == gap
    assert ticket.gap == (4, 7)
    ctrl.check_integrity()
    ctrl.wait_ticket(ticket)
    ctrl.release(ticket)
    ctrl.check_integrity()
    m = ctrl.tree.match_prefix(tokens, touch=False)
    assert [(t, n.num_pages) for n, t in m.segments] == [(DEVICE, 2), (DEVICE, 2), (DISK, 3), (DEVICE, 1)]
    h.check_all_bytes()


def test_no_room_for_the_tail_drops_the_gap():
    h, tokens = restarted(device=2)
    ticket = h.ctrl.acquire(tokens, max_pages=8, overlap=True)  # the locked prefix fills the GPU
    assert ticket.gap is None and ticket.num_pages == 2 and ticket.hit_pages == {DEVICE: 2}
    h.ctrl.check_integrity()
    h.ctrl.release(ticket)
    h.ctrl.check_integrity()


def test_prefetch_reads_the_deepest_pages_first_and_the_request_computes_the_head_while_they_load():
    """With overlap, a queued request's prefetch that has room for half its disk prefix reads the last half: the
    deep pages, dearest to recompute. Admitted, the request computes the first half while the second comes from host
    memory, and the bytes are those computed."""
    page_bytes = LAYOUT.page_bytes
    # a page computes in 1 ms, loads from host in 0.1 ms and from disk in 5 ms: the disk alone does not pay
    cost = CostModel(PS, page_bytes, "auto", PS / 1e-3, page_bytes / 1e-4, page_bytes / 5e-3, adaptive=False,
                     overlap=True)
    l3 = MemoryL3(64, page_bytes)
    first = Harness(device=16, host=16, disk=64, l3=l3)
    first.run(seq(1, 8))
    first.close()
    h = Harness(device=16, host=8, disk=64, l3=l3, cost=cost)  # prefetch room: half of 8 host pages
    hold = h.ctrl.prefetch(seq(1, 8), max_pages=8)
    assert hold.started == 4 and hold.short
    h.ctrl.poll()
    m = h.ctrl.tree.match_prefix(seq(1, 8), touch=False)
    assert [(tier, node.num_pages) for node, tier in m.segments] == [(DISK, 4), (HOST, 4)]
    ticket = h.ctrl.acquire(tuple(seq(1, 8)), max_pages=8, overlap=True)
    h.ctrl.release_prefetch(hold)
    assert ticket.gap == (0, 4) and ticket.hit_pages == {DISK: 4}  # pages [4, 8) were read from disk
    gap = h.ctrl.alloc_device(4)
    for i, p in enumerate(gap):
        h.dev.kv[:, :, p] = page_value(tuple(seq(1, 8)), i)
    h.ctrl.commit_gap(ticket, tuple(seq(1, 8)), gap)
    assert h.ctrl.wait_ticket(ticket) and ticket.gap is None
    for i, p in enumerate(ticket.device_pages()):
        assert torch.all(h.dev.kv[:, :, p] == page_value(tuple(seq(1, 8)), i))
    h.ctrl.release(ticket)
    h.ctrl.check_integrity()
    h.close()
