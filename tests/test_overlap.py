"""Compute the prefix's first pages while loading its last: the cost model's three-way plan."""

from __future__ import annotations

import dataclasses

from controller import CostModel
from controller.cost import LoadPlan
from radix import DEVICE, DISK, HOST


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


def test_plan_needs_auto_mode_and_known_costs():
    runs = [(DEVICE, 1), (DISK, 4)]
    assert unit_cost(mode="never").plan(runs) == LoadPlan(1, 1, 1)
    assert unit_cost(mode="always").plan(runs) == LoadPlan(5, 5, 5)
    unknown = dataclasses.replace(unit_cost(), disk_to_device_bytes_per_s=None)  # loading counts as free
    assert unknown.plan(runs) == LoadPlan(5, 5, 5)
    assert dataclasses.replace(unit_cost(), prefill_tokens_per_s=None).plan(runs) == LoadPlan(5, 5, 5)
    # an unknown host bandwidth does not matter when no page is on host
    assert dataclasses.replace(unit_cost(), host_to_device_bytes_per_s=None).plan(runs) == LoadPlan(1, 4, 5)
