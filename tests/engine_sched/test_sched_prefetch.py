"""Prefetch: a queued request's prefix that sits only on L3 is read into host memory while other requests
compute, so at admission it loads from host even where the disk is too slow to beat recomputing."""

from __future__ import annotations

import dataclasses

from sched_helpers import assert_no_leaks, run_all, settle_l3
from test_sched_overlap import GREEDY, A, hold_reads, l3_engine, reference, slow_disk_engine

from hicache.engine.params import SamplingParams

B = [(5 * 17 + i * 11) % 250 + 1 for i in range(200)]  # an unrelated long prompt that keeps A queued


def queue_behind_b(engine):
    """B first, then A (A waits: B's backlog fills the step budget); run one step, let A's reads land."""
    engine.add_request("b", B, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.add_request("a", A, GREEDY)
    first = engine.step()
    assert engine.requests["a"] in engine.scheduler.waiting and all(o.request_id == "b" for o in first)
    engine.cache.controller.worker.wait_idle()
    return run_all(engine)["a"]


def test_queued_request_loads_its_disk_prefix_from_host(tiny, tmp_path):
    want = reference(tiny, tmp_path)  # A recomputed; A's pages are now on L3 only (after a restart)

    alone = slow_disk_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16)
    ids, _, out = run_all_one(alone)
    assert ids == want and out.usage.cached_tokens == {"device": 0, "host": 0, "disk": 0, "remote": 0}  # disk too slow
    alone.close()

    engine = slow_disk_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16)
    ids, _, out = queue_behind_b(engine)
    assert ids == want
    assert out.usage.cached_tokens == {"device": 0, "host": 0, "disk": 60, "remote": 0}  # from L3, via host memory
    cache = engine.stats()["cache"]
    assert cache["prefetched_pages"] == 15 and cache["pages_promoted"]["disk->host"] == 15
    assert_no_leaks(engine)
    engine.close()

    off = slow_disk_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16, cache__load_policy__prefetch=False)
    ids, _, out = queue_behind_b(off)
    assert ids == want and out.usage.cached_tokens["disk"] == 0
    assert off.stats()["cache"]["prefetched_pages"] == 0
    off.close()


def run_all_one(engine):
    engine.add_request("a", A, GREEDY)
    return run_all(engine)["a"]


def test_request_waits_for_pages_another_request_is_loading(tiny, tmp_path):
    """Y recomputes A (the disk is slow); W then loads A's later pages (mode always). When Y commits those
    pages, W's copies win the dedup while still in flight: Y must not run on them until they land."""
    want = reference(tiny, tmp_path)
    engine = slow_disk_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16)
    go = hold_reads(engine)
    engine.add_request("y", A, GREEDY)
    tokens: dict[str, list[int]] = {"y": [], "w": []}

    def step():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        engine.cache.controller.check_integrity()

    step()  # Y: 4 pages computed, the rest on L3 only
    y = engine.requests["y"]
    assert y.computed == 16 and sum(y.cached_tokens.values()) == 0
    engine.cache.controller.cost = dataclasses.replace(engine.cache.controller.cost, mode="always")
    engine.add_request("w", A, GREEDY)
    blocked = False
    for _ in range(20):
        step()
        blocked = blocked or y.awaiting_loads
        if blocked and y.computed < len(A):
            break
    assert blocked and engine.requests["w"].cached_tokens["disk"] > 0
    computed = y.computed
    step()
    assert y.computed == computed  # not planned while its pages load
    go.set()
    for rid, (ids, _, _) in run_all(engine).items():
        tokens[rid] += ids
    assert tokens == {"y": want, "w": want}
    assert_no_leaks(engine)
    engine.close()


def test_prefetch_room_goes_to_the_front_of_the_queue(tiny, tmp_path):
    """Three queued requests whose prefixes are on L3 only, host room for one prefix's reads at a time: the first
    is prefetched, the second reads the page that still fits and stops short, and the third is not tried. When the
    first leaves the queue, the second goes on where it stopped, ahead of the third."""
    prompts = {name: [(seed * 31 + i * 7) % 250 + 1 for i in range(61)] for name, seed in (("q1", 3), ("q2", 5),
                                                                                           ("q3", 9))}
    writer = l3_engine(tiny, tmp_path / "l3")
    for name, prompt in prompts.items():
        writer.add_request(name, prompt, GREEDY)
    run_all(writer)
    writer.close()
    # a restart with 32 host pages: held reads may cover 16, one prompt's 15
    engine = slow_disk_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16, cache__host__size_tokens=128)
    go = hold_reads(engine)
    engine.add_request("b", B, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, GREEDY)
    engine.step()
    q1, q2, q3 = (engine.requests[name] for name in prompts)
    assert all(r in engine.scheduler.waiting for r in (q1, q2, q3))
    assert q1.prefetch_hold.started == 15 and not q1.prefetch_hold.short
    assert q2.prefetch_hold.pages == 1 and q2.prefetch_hold.short
    assert not q3.prefetched and q3.prefetch_hold is None
    engine.step()  # no room freed: q2 stays short, q3 untried
    assert q2.prefetch_hold.short and q3.prefetch_hold is None
    engine.abort("q1")  # leaves the queue: its hold is given back, but its reads still fill host pages
    engine.step()
    assert q2.prefetch_hold.started == 1 and q2.prefetch_hold.short and q3.prefetch_hold is None
    go.set()
    settle_l3(engine)  # q1's reads land: their pages are room again
    engine.step()
    assert q2.prefetch_hold.started == 15 and not q2.prefetch_hold.short
    assert q3.prefetch_hold.pages == 1 and q3.prefetch_hold.short  # its turn now, but q2's pages hold the room
    # the reads land before q2 is admitted: admitted while its read is still in flight, q2 would (rightly) recompute
    # whenever the read's expected landing is further off than recomputing (a timing race on a loaded machine)
    settle_l3(engine)
    outputs = run_all(engine)
    # from L3, via host
    assert outputs["q2"][2].usage.cached_tokens == {"device": 0, "host": 0, "disk": 60, "remote": 0}
    assert engine.stats()["cache"]["prefetched_pages"] >= 30
    assert_no_leaks(engine)
    engine.close()
