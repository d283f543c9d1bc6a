"""Recompute cost that grows with a page's depth in the prompt (CostModel.attention_seconds_per_pair): page costs,
load plans at depth, the L3 write gate judged at the prompts' length, and the startup calibration of the term."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_controller import LAYOUT

from controller import CostModel
from controller.cost import LoadPlan
from hicache.cache import cost_model
from hicache.config import ConfigError, from_dict
from hicache.engine.assembly import attention_probe_sizes, calibrate_attention, scratch_prefill
from hicache.engine.weights import load_model
from radix import DISK, HOST


def deep_cost(disk_s: float = 3.0, overlap: bool = False) -> CostModel:
    """Page size 2, 1 byte a page; a token costs 1 s plus 0.5 s per earlier token; a disk page loads in disk_s."""
    return CostModel(2, 1, "auto", 1.0, 1e9, 1.0 / disk_s, attention_seconds_per_pair=0.5, adaptive=False,
                     overlap=overlap)


def test_a_page_costs_more_the_deeper_it_sits():
    cost = deep_cost()
    # page i holds tokens 2i and 2i + 1: 2 s, plus 0.5 s for each earlier token of each
    assert [cost.compute_seconds(i) for i in range(4)] == [2.5, 4.5, 6.5, 8.5]
    assert cost.compute_seconds(0, 4) == 22.0 == sum(cost.compute_seconds(i) for i in range(4))
    assert cost.compute_seconds(2, 2) == 0.0
    flat = dataclasses.replace(cost, attention_seconds_per_pair=0.0)
    assert flat.compute_seconds(0, 4) == 8.0 and flat.compute_seconds(3) == 2.0
    assert CostModel(2, 1).compute_seconds(5) == float("inf")  # no prefill speed: loading counts as free


def test_a_disk_too_slow_for_short_prompts_pays_for_long_ones():
    cost = deep_cost(disk_s=5.0)
    assert cost.pages_to_load([(DISK, 1)]) == 0  # 5 s to load against 2.5 s to compute
    assert cost.pages_to_load([(DISK, 2)]) == 0  # 10 s against 7 s
    assert cost.pages_to_load([(DISK, 3)]) == 0  # 15 s against 2.5 + 4.5 + 6.5 = 13.5 s
    assert cost.pages_to_load([(DISK, 4)]) == 4  # 20 s against 22 s: the whole prefix pays
    assert cost.pages_to_load([(HOST, 1), (DISK, 1)]) == 1  # host page yes; a 4.5 s page at depth 1 no
    assert cost.pages_to_load([(HOST, 1), (DISK, 2)]) == 3  # 4.5 + 6.5 = 11 s of compute against 10 s of loads
    assert dataclasses.replace(cost, attention_seconds_per_pair=0.0).pages_to_load([(DISK, 40)]) == 0
    faster = dataclasses.replace(cost, disk_to_device_bytes_per_s=cost.page_bytes / 1.0)  # 1 s a page
    assert faster.pages_to_load([(DISK, 1)]) == 1  # pays from the start
    assert cost.pays_from_token(DISK) == 2 * 2  # page 2 (6.5 s) is the first dearer to compute than 5 s to load
    assert cost.pays_from_token(HOST) == 0
    assert dataclasses.replace(cost, attention_seconds_per_pair=0.0).pays_from_token(DISK) is None


def test_overlap_computes_the_cheap_first_pages_while_the_deep_ones_load():
    cost = deep_cost(disk_s=10.0, overlap=True)
    plan = cost.plan([(DISK, 6)])
    # compute [0, s) while [s, 6) loads at 10 s a page; the balance is s = 4: compute [0, 4) = 22 s, load [4, 6)
    # = 20 s
    assert plan == LoadPlan(0, 4, 6)
    assert cost.finish_seconds([(DISK, 6)], plan) == 22.0
    assert cost.finish_seconds([(DISK, 6)], LoadPlan(0, 0, 0)) == cost.compute_seconds(0, 6) == 45.0
    # a flat model sees 2 s a page: it computes more of the prefix and loads less of it
    flat = dataclasses.replace(cost, attention_seconds_per_pair=0.0)
    assert flat.plan([(DISK, 6)]) == LoadPlan(0, 5, 6)


def test_calibrate_attention_recovers_the_pair_cost():
    a, b = 2e-5, 7e-10

    def run(n: int, context: int) -> float:  # linear part, causal attention in the chunk, attention to the context
        return n * a + b * n * (n - 1) / 2 + b * n * context

    assert calibrate_attention(None, 64, 2048, 14336, run=run) == pytest.approx(b, rel=1e-9)
    noisy = iter([1.0, 1.0, 0.9, 0.95])  # the deep chunk timed faster (noise): no negative price
    assert calibrate_attention(None, 64, 64, 128, run=lambda n, c: next(noisy)) == 0.0


def test_scratch_prefill_times_a_chunk_over_a_prefix_on_a_real_model():
    model, _ = load_model("random:tiny", torch.float32, torch.device("cpu"))
    assert scratch_prefill(model, 16, 32) > 0 and scratch_prefill(model, 16, 32, context=48) > 0
    chunk, context = attention_probe_sizes(model, 16, speed=1000.0)
    assert chunk == 64 and context == 128  # the CPU probe: a chunk of ~budget/8 of prefill, twice that of context
    assert attention_probe_sizes(model, 16, speed=1e6) == (512, 1024)


def test_attention_cost_config():
    layout = LAYOUT
    cfg = from_dict({"cache": {"load_policy": {"attention_ns_per_pair": 0.9}}})
    assert cost_model(cfg, layout, 1000.0, 5e-9).attention_seconds_per_pair == pytest.approx(0.9e-9)  # config wins
    assert cost_model(from_dict({}), layout, 1000.0, 5e-9).attention_seconds_per_pair == 5e-9  # calibrated
    assert cost_model(from_dict({}), layout, 1000.0).attention_seconds_per_pair == 0.0
    assert cost_model(from_dict({"cache": {"load_policy": {"attention_ns_per_pair": 0}}}), layout, 1.0, 5e-9) \
        .attention_seconds_per_pair == 0.0
    with pytest.raises(ConfigError, match="attention_ns_per_pair: must be >= 0"):
        from_dict({"cache": {"load_policy": {"attention_ns_per_pair": -1.0}}})
    assert deep_cost().describe()["attention_ns_per_pair"] == 0.5e9
    assert deep_cost(disk_s=5.0).describe()["disk_pays_from_token"] == 4
