"""random:tiny with cache.load_policy.overlap: a prefix on L3 only, on a disk slower than compute, is
partly computed while its last pages load; greedy output equals recomputing or loading the prefix."""

from __future__ import annotations

import threading

import pytest
from sched_helpers import assert_no_leaks, make_engine, run_all

from hicache.engine.params import SamplingParams
from hicache.engine.request import Status
from radix import DISK

PAGE = 4
A = [(3 * 31 + i * 7) % 250 + 1 for i in range(61)]  # 15 full pages and one token
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def l3_engine(tiny, path, **dotted):
    """An engine over an L3 store at `path` (tiers of 512 / 512 / 1024 tokens unless `dotted` says otherwise). Its
    scheduler's clock stands still: with the costs configured here a real read may outlast its deadline on a busy
    machine, and the tests of deadlines move the clock themselves."""
    config = {"cache__page_size": PAGE, "cache__device__size_tokens": 512, "cache__host__size_tokens": 512,
              "cache__l3__path": str(path), "cache__l3__size_gib": None, "cache__l3__size_tokens": 1024,
              "cache__write_policy__host_to_disk": "write_through"}
    engine = make_engine(tiny, **{**config, **dotted})
    engine.scheduler.clock = engine.cache.controller.loads.clock = lambda: 0.0
    return engine


def page_bytes(tiny) -> int:
    """KV bytes of one page of random:tiny in float32."""
    c = tiny[0].config
    return c.num_layers * 2 * PAGE * c.num_kv_heads * c.head_dim * 4


def slow_disk_engine(tiny, path, **dotted):
    """Prefill 1000 tokens/s (4 ms a page); the disk loads a page in 8 ms (recompute wins), host in 1 ms. One cut
    (load a prefix, compute the rest) unless `dotted` turns overlap on."""
    gbps = lambda seconds: page_bytes(tiny) / seconds / 1e9  # noqa: E731
    dotted.setdefault("cache__load_policy__overlap", False)
    dotted.setdefault("cache__load_policy__disk_to_device_gbps", gbps(0.008))
    return l3_engine(tiny, path, cache__load_policy__prefill_tokens_per_s=1000.0,
                     cache__load_policy__host_to_device_gbps=gbps(0.001), **dotted)


def overlap_engine(tiny, path, **dotted):
    return slow_disk_engine(tiny, path, cache__load_policy__overlap=True, **dotted)


def generate(engine, request_id: str = "a"):
    engine.add_request(request_id, A, GREEDY)
    return run_all(engine)[request_id]


def reference(tiny, tmp_path) -> list[int]:
    """A's output with its prefix recomputed, after which A is on L3 (written through) for a restart."""
    engine = l3_engine(tiny, tmp_path / "l3")
    ids, _, out = generate(engine)
    assert out.usage.total_cached_tokens == 0
    engine.close()
    return ids


def test_overlap_matches_recompute_and_load(tiny, tmp_path):
    want = reference(tiny, tmp_path)
    loaded = l3_engine(tiny, tmp_path / "l3", cache__load_policy__mode="always")  # a restart: A only on L3
    ids, _, out = generate(loaded)
    assert out.usage.cached_tokens == {"device": 0, "host": 0, "disk": 60, "remote": 0} and ids == want
    loaded.close()

    engine = overlap_engine(tiny, tmp_path / "l3")
    k, s, n = engine.cache.controller.cost.plan([(DISK, 15)])
    assert (k, s, n) == (0, 10, 15)  # compute 10 pages (40 ms) while 5 load (40 ms)
    ids, _, out = generate(engine)
    assert ids == want
    # the gap is recomputed
    assert out.usage.cached_tokens == {"device": 0, "host": 0, "disk": (n - s) * PAGE, "remote": 0}
    assert engine.stats()["cache"]["recomputed_tokens"] == (s - k) * PAGE
    assert_no_leaks(engine)
    ids, _, out = generate(engine, "b")  # all of it is on GPU now
    assert ids == want and out.usage.cached_tokens["device"] == 60
    engine.close()


def hold_reads(engine, fail: bool = False) -> threading.Event:
    """L3 reads block until the returned event is set (then fail, with `fail`)."""
    store = engine.cache.controller.l3
    real = store.read_pages
    go = threading.Event()

    def read(keys, out, *args, **kwargs):
        assert go.wait(10)
        return [False] * len(keys) if fail else real(keys, out, *args, **kwargs)

    store.read_pages = read
    return go


def run_gap_then_release(engine, go: threading.Event):
    """Step until A has computed its gap and waits for its tail; then let the reads finish. The scheduler's clock
    stands still (l3_engine), so A waits for its tail however slowly the steps run."""
    engine.add_request("a", A, GREEDY)
    req = engine.requests["a"]
    results = {}
    for _ in range(50):
        for o in engine.step():
            results[o.request_id] = o
        engine.cache.controller.check_integrity()
        if req.status is Status.LOADING and req.ticket.gap is None:
            break
    assert req.status is Status.LOADING and req.computed == 15 * PAGE and req.gap_tokens == 10 * PAGE
    go.set()
    rest = run_all(engine)["a"]
    return rest


def test_gap_computed_before_the_tail_lands(tiny, tmp_path):
    want = reference(tiny, tmp_path)
    engine = overlap_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16)  # the gap takes 3 steps
    go = hold_reads(engine)
    ids, _, out = run_gap_then_release(engine, go)
    assert ids == want and out.usage.cached_tokens == {"device": 0, "host": 0, "disk": 20, "remote": 0}
    assert_no_leaks(engine)
    engine.close()


def test_failed_tail_after_the_gap_is_recomputed(tiny, tmp_path):
    want = reference(tiny, tmp_path)
    engine = overlap_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16)
    go = hold_reads(engine, fail=True)
    ids, _, out = run_gap_then_release(engine, go)
    assert engine.stats()["cache"]["load_failures"] >= 1
    assert ids == want and out.usage.cached_tokens == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    assert_no_leaks(engine)
    engine.close()


def test_abort_mid_gap_keeps_the_computed_pages(tiny, tmp_path):
    want = reference(tiny, tmp_path)
    engine = overlap_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16)
    go = hold_reads(engine)
    engine.add_request("a", A, GREEDY)
    engine.step()  # 16 tokens of the gap: 4 pages
    req = engine.requests["a"]
    assert req.ticket.gap == (0, 10) and req.computed == 16
    engine.abort("a")
    assert engine.scheduler.draining  # the tail is still loading: its lock is kept until it lands
    engine.cache.controller.check_integrity()
    go.set()
    m = engine.cache.controller.tree.match_prefix(A, touch=False)
    assert m.device_pages >= 4  # the gap pages computed before the abort are cached
    ids, _, _ = generate(engine, "b")
    assert ids == want
    assert_no_leaks(engine)
    engine.close()


class StepClock:
    """A scheduler clock that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stuck_request(engine):
    """A on an engine whose clocks (the scheduler's and the read estimates') move only when the test says and whose
    L3 reads block until the returned event is set: (clock, event, A's request)."""
    clock = StepClock()
    engine.scheduler.clock = engine.cache.controller.loads.clock = clock
    go = hold_reads(engine)
    engine.add_request("a", A, GREEDY)
    return clock, go, engine.requests["a"]


def test_a_stuck_tail_read_delays_the_request_no_longer_than_recomputing_it(tiny, tmp_path):
    """The tail's reads never land while the request waits: once the time to recompute them has passed, it computes
    them itself, with the same greedy output; the reads land in host memory later, for the next request."""
    want = reference(tiny, tmp_path)
    engine = overlap_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16)
    clock, go, req = stuck_request(engine)
    for _ in range(50):
        engine.step()
        if req.status is Status.LOADING and req.ticket.gap is None:
            break
    assert req.status is Status.LOADING and req.computed == 15 * PAGE
    # the tail is 5 pages at 4 ms each to recompute, and nothing else is running: the deadline is 20 ms away
    assert req.load_deadline == clock.now + engine.cache.controller.cost.compute_seconds(10, 15)
    clock.now = req.load_deadline - 1e-6
    engine.step()
    assert req.status is Status.LOADING  # not yet
    clock.now = req.load_deadline
    ids, out = [], None
    for _ in range(100):  # until A finishes (run_all would also wait for the reads it gave up)
        for o in engine.step():
            ids += o.new_token_ids
            out = o
        engine.cache.controller.check_integrity()
        if req.status is Status.FINISHED:
            break
    assert ids == want
    assert out.usage.cached_tokens == {"device": 0, "host": 0, "disk": 0, "remote": 0}  # the tail was computed
    cache = engine.stats()["cache"]
    assert cache["gave_up_reads"] == 1
    assert cache["recomputed_tokens"] == 15 * PAGE  # the gap, then the tail
    assert engine.scheduler.draining  # the abandoned reads are still in flight, under the old lock
    go.set()
    run_all(engine)  # drains once the reads land
    assert not engine.scheduler.draining
    tree = engine.cache.controller.tree
    m = tree.match_prefix(A, touch=False)
    assert m.device_pages == 15  # the pages the request computed
    assert sum(n.num_pages for n in tree.nodes() if n.on_host) >= 5  # and the reads' pages landed in host memory
    assert_no_leaks(engine)
    ids, _, out = generate(engine, "b")
    assert ids == want and out.usage.cached_tokens["device"] == 60
    engine.close()


def test_a_stuck_prefix_read_gives_way_to_compute(tiny, tmp_path):
    """The prefix only on L3, on a disk that loads a page in 3.5 ms against 4 ms to recompute it: the request
    rides all 15 reads (due in 52.5 ms), and they are stuck. Nothing else runs, so its deadline is the recompute
    time (60 ms, earlier than the estimate plus a quarter of it); past that it computes it all."""
    want = reference(tiny, tmp_path)
    engine = slow_disk_engine(tiny, tmp_path / "l3",
                              cache__load_policy__disk_to_device_gbps=page_bytes(tiny) / 0.0035 / 1e9)
    clock, go, req = stuck_request(engine)
    engine.step()
    assert req.status is Status.LOADING
    assert req.load_deadline == engine.cache.controller.cost.compute_seconds(0, 15)
    for _ in range(3):
        engine.step()
    assert req.status is Status.LOADING and not engine.scheduler.draining
    clock.now = 1.0
    first = [t for o in engine.step() for t in o.new_token_ids]
    assert req.status is Status.RUNNING and req.computed == len(A)  # computed all of it in that step
    assert engine.scheduler.draining  # the reads it gave up still hold their lock
    go.set()
    ids, _, out = run_all(engine)["a"]
    assert first + ids == want and out.usage.total_cached_tokens == 0
    assert engine.stats()["cache"]["hit_tokens"]["disk"] == 0  # the hits counted at admission were taken back
    assert not engine.scheduler.draining
    assert_no_leaks(engine)
    engine.close()


def test_load_mode_always_waits_for_its_reads_however_late(tiny, tmp_path):
    """Mode always loads every hit: a disk slower than recomputing, reads stuck for an hour of the scheduler's
    clock, and the request still waits for them and is served from the disk."""
    want = reference(tiny, tmp_path)
    engine = slow_disk_engine(tiny, tmp_path / "l3", cache__load_policy__mode="always")
    clock, go, req = stuck_request(engine)
    engine.step()
    assert req.status is Status.LOADING and req.load_deadline == float("inf")
    clock.now = 3600.0
    for _ in range(3):
        assert not [o for o in engine.step() if o.new_token_ids]
    assert req.status is Status.LOADING and engine.stats()["cache"]["gave_up_reads"] == 0
    go.set()
    ids, _, out = run_all(engine)["a"]
    assert ids == want and out.usage.cached_tokens == {"device": 0, "host": 0, "disk": 60, "remote": 0}
    assert_no_leaks(engine)
    engine.close()


def test_with_nothing_else_running_a_late_read_is_given_up_a_quarter_of_its_recompute_time_after_its_estimate(
        tiny, tmp_path):
    """A disk estimated at 1 ms a page against 4 ms to recompute one: the request rides the reads. Nothing else
    runs, so it waits for their estimated landing (15 ms) plus a quarter of the recompute time (60 ms), not the
    whole recompute time: stuck past that, it computes the prefix itself."""
    want = reference(tiny, tmp_path)
    engine = l3_engine(tiny, tmp_path / "l3", cache__load_policy__prefill_tokens_per_s=1000.0,
                       cache__load_policy__host_to_device_gbps=page_bytes(tiny) / 1e-4 / 1e9,
                       cache__load_policy__disk_to_device_gbps=page_bytes(tiny) / 1e-3 / 1e9,
                       cache__load_policy__overlap=False)
    clock, go, req = stuck_request(engine)
    engine.step()
    assert req.status is Status.LOADING
    recompute = engine.cache.controller.cost.compute_seconds(0, 15)
    assert recompute == pytest.approx(0.06)
    assert req.load_deadline == pytest.approx(0.015 + 0.25 * recompute)
    clock.now = req.load_deadline
    first = [t for o in engine.step() for t in o.new_token_ids]
    assert req.status is Status.RUNNING and engine.stats()["cache"]["gave_up_reads"] == 1
    go.set()
    ids, _, out = run_all(engine)["a"]
    assert first + ids == want and out.usage.total_cached_tokens == 0
    assert_no_leaks(engine)
    engine.close()


def test_a_request_waiting_for_its_prefix_reads_does_not_hold_the_queue(tiny, tmp_path):
    """X is A plus 24 tokens: its 15-page prefix is on the disk only, and the reads are stuck (mode always: X waits
    for them however long). Its 24 tokens to compute are more than a step's 16, yet they cannot start before the
    reads land, so B (another prompt) is admitted and served meanwhile. Both outputs are those of a server that
    recomputes."""
    x_prompt = A + [(i * 13) % 250 + 1 for i in range(24)]
    b_prompt = [(i * 11) % 250 + 1 for i in range(30)]
    want = {}
    fresh = l3_engine(tiny, tmp_path / "fresh", scheduler__chunk_tokens=16)
    for rid, prompt in (("x", x_prompt), ("b", b_prompt)):
        fresh.add_request(rid, prompt, GREEDY)
        want[rid] = run_all(fresh)[rid][0]
    fresh.close()
    reference(tiny, tmp_path)  # A on the L3 at tmp_path / "l3"
    engine = slow_disk_engine(tiny, tmp_path / "l3", scheduler__chunk_tokens=16, cache__load_policy__mode="always")
    go = hold_reads(engine)
    engine.add_request("x", x_prompt, GREEDY)
    x = engine.requests["x"]
    engine.add_request("b", b_prompt, GREEDY)
    got = {"x": [], "b": []}
    for _ in range(40):
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        engine.cache.controller.check_integrity()
        if engine.requests.get("b") is None:
            break
    assert x.status is Status.LOADING and x.cached_tokens["disk"] == 60  # still waiting for its reads
    assert got["b"] == want["b"] and got["x"] == []  # B was served meanwhile
    go.set()
    for rid, (ids, _, _) in run_all(engine).items():
        got[rid] += ids
    assert got == want
    assert_no_leaks(engine)
    engine.close()
