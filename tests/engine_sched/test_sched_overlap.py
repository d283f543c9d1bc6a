"""random:tiny with cache.load_policy.overlap: a prefix on L3 only, on a disk slower than compute, is
partly computed while its last pages load; greedy output equals recomputing or loading the prefix."""

from __future__ import annotations

import threading

from sched_helpers import assert_no_leaks, make_engine, run_all

from hicache.engine.params import SamplingParams
from hicache.engine.request import Status
from radix import DISK

PAGE = 4
A = [(3 * 31 + i * 7) % 250 + 1 for i in range(61)]  # 15 full pages and one token
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def l3_engine(tiny, path, **dotted):
    """An engine over an L3 store at `path` (tiers of 512 / 512 / 1024 tokens unless `dotted` says otherwise)."""
    config = {"cache__page_size": PAGE, "cache__device__size_tokens": 512, "cache__host__size_tokens": 512,
              "cache__l3__path": str(path), "cache__l3__size_gib": None, "cache__l3__size_tokens": 1024,
              "cache__write_policy__host_to_disk": "write_through"}
    return make_engine(tiny, **{**config, **dotted})


def slow_disk_engine(tiny, path, **dotted):
    """Prefill 1000 tokens/s (4 ms a page); the disk loads a page in 8 ms (recompute wins), host in 1 ms."""
    c = tiny[0].config
    page_bytes = c.num_layers * 2 * PAGE * c.num_kv_heads * c.head_dim * 4
    gbps = lambda seconds: page_bytes / seconds / 1e9  # noqa: E731
    return l3_engine(tiny, path, cache__load_policy__prefill_tokens_per_s=1000.0,
                     cache__load_policy__host_to_device_gbps=gbps(0.001),
                     cache__load_policy__disk_to_device_gbps=gbps(0.008), **dotted)


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
    """Step until A has computed its gap and waits for its tail; then let the reads finish."""
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
