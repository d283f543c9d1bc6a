"""Tenants on the engine: another tenant's exact prompt is a miss on every tier (GPU, host, the L3, after a restart,
the remote tier between two servers) and gives the same tokens; a salt is a namespace of its own; a tenant that
floods the cache leaves another tenant's hot prefix cached when each has a share."""

from __future__ import annotations

import pytest
from sched_helpers import assert_no_leaks, make_engine, run_all, settle_l3

from hicache.engine.params import SamplingParams
from hicache.server.tenants import Tenants

PAGE = 4
P = [(7 * i + 3) % 250 + 1 for i in range(41)]  # 10 full pages and a token
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
FULL = (len(P) - 1) // PAGE * PAGE  # a request keeps its last token to compute: 40 tokens can be cached


@pytest.fixture
def tenants(tmp_path) -> Tenants:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  alice: {keys: [ka]}\n  bob: {keys: [kb]}\n  ops: {keys: [ko], shared: true}\n")
    return Tenants.build(None, str(path))


def ns(tenants: Tenants, name: str, salt: str | None = None):
    return tenants.namespace(next(t for t in tenants.tenants if t.name == name), salt)


def send(engine, namespace, prompt=P, rid=[0]):  # noqa: B006  # a counter for unique request ids
    """Run one request; then let its pages' L3 writes land."""
    rid[0] += 1
    engine.add_request(f"r{rid[0]}", prompt, GREEDY, namespace)
    result = run_all(engine)[f"r{rid[0]}"]
    settle_l3(engine)
    return result


def tiers(tmp_path, **more):
    return {"cache__page_size": PAGE, "cache__device__size_tokens": 16 * PAGE, "cache__host__size_tokens": 32 * PAGE,
            "cache__l3__path": str(tmp_path / "l3"), "cache__l3__size_gib": None, "cache__l3__size_tokens": 4096,
            "cache__write_policy__device_to_host": "write_through", "cache__write_policy__host_to_disk":
            "write_through", "cache__load_policy__mode": "always", **more}


def fillers(n: int, seed: int) -> list[list[int]]:
    return [[(seed * 31 + j * 17 + i * 5) % 250 + 1 for i in range(41)] for j in range(n)]


def test_another_tenants_prompt_is_a_miss_on_every_tier_and_after_a_restart(tiny, tmp_path, tenants):
    """Each check sends alice's prompt from a namespace that never sent it (bob with a salt of his own is one):
    a miss, the same tokens. Alice's own pages stay hers on the GPU, the L3 and after a restart."""
    alice, bob, ops = ns(tenants, "alice"), ns(tenants, "bob"), ns(tenants, "ops")
    engine = make_engine(tiny, **tiers(tmp_path))
    want, _, out = send(engine, alice)
    assert out.usage.total_cached_tokens == 0
    for other in (bob, ops, ns(tenants, "alice", salt="s1")):  # GPU: another tenant, the shared one, a salt
        ids, _, out = send(engine, other)
        assert ids == want and out.usage.total_cached_tokens == 0
    ids, _, out = send(engine, alice)  # the GPU holds one prompt's pages: alice's came back from host or disk
    assert ids == want and out.usage.total_cached_tokens == FULL
    for prompt in fillers(8, seed=1):  # alice's pages leave the GPU and host memory: they are on the L3 only
        send(engine, ops, prompt)
    ids, _, out = send(engine, ns(tenants, "bob", salt="fresh-1"))
    assert ids == want and out.usage.total_cached_tokens == 0
    ids, _, out = send(engine, alice)
    assert ids == want and out.usage.cached_tokens["disk"] == FULL
    assert_no_leaks(engine)
    engine.close()

    engine = make_engine(tiny, **tiers(tmp_path))  # a restart on the same L3
    ids, _, out = send(engine, ns(tenants, "bob", salt="fresh-2"))
    assert ids == want and out.usage.total_cached_tokens == 0
    for own in (alice, bob, ns(tenants, "alice", salt="s1")):  # each namespace finds what it wrote
        ids, _, out = send(engine, own)
        assert ids == want and out.usage.cached_tokens["disk"] == FULL
    assert_no_leaks(engine)
    engine.close()


def test_another_tenants_prompt_is_a_miss_through_the_shared_tier(tiny, valkey, tmp_path, tenants):
    """Two servers, one Valkey: alice's prefix computed on the first is a remote-tier hit for alice on the second,
    and a miss for bob."""
    shared = {"cache__page_size": PAGE, "cache__device__size_tokens": 16 * PAGE,
              "cache__host__size_tokens": 16 * PAGE, "cache__remote__url": valkey.url,
              "cache__remote__key_prefix": f"tenants-{tmp_path.name}", "cache__remote__size_tokens": 4096,
              "cache__write_policy__defer_above_free": 1.0, "cache__write_policy__host_to_disk": "write_through",
              "cache__load_policy__mode": "always"}
    first = make_engine(tiny, **shared)
    want, _, _ = send(first, ns(tenants, "alice"))
    settle_l3(first)
    first.close()
    second = make_engine(tiny, **shared)
    ids, _, out = send(second, ns(tenants, "bob"))
    assert ids == want and out.usage.total_cached_tokens == 0
    ids, _, out = send(second, ns(tenants, "alice"))
    assert ids == want and out.usage.cached_tokens["remote"] == FULL
    second.close()


@pytest.mark.parametrize("with_shares", [False, True])
def test_a_tenant_flooding_the_cache_leaves_anothers_hot_prefix_when_each_has_a_share(tiny, tmp_path, with_shares):
    """GPU and host tiers of 16 pages each, no L3. Alice's 10-page prefix is hot; bob sends 8 prompts of 10 new
    pages. Without shares LRU takes alice's pages from both tiers; with shares (alice 0.7 of each tier, 11 pages;
    bob 0.2, 3 pages) bob's backups to host memory would put him over his share, so they evict only his own
    pages (or are dropped), and alice's prefix stays."""
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  alice: {keys: [ka], share: 0.7}\n  bob: {keys: [kb], share: 0.2}\n")
    tenants = Tenants.build(None, str(path))
    assert tenants.shares() == {1: 0.7, 2: 0.2}
    engine = make_engine(tiny, cache__page_size=PAGE, cache__device__size_tokens=16 * PAGE,
                         cache__host__size_tokens=16 * PAGE, cache__write_policy__device_to_host="write_through",
                         cache__load_policy__mode="always")
    if with_shares:
        engine.cache.controller.set_shares(tenants.shares())
    alice, bob = ns(tenants, "alice"), ns(tenants, "bob")
    want, _, _ = send(engine, alice)
    for prompt in fillers(8, seed=2):
        send(engine, bob, prompt)
    held = engine.stats()["group_pages"]
    ids, _, out = send(engine, alice)
    assert ids == want
    if with_shares:
        assert out.usage.total_cached_tokens == FULL
        # the GPU makes room for bob's running requests from anyone's pages; host memory, a cache, keeps alice's
        assert held["host"][alice.group] >= 10 and held["host"].get(bob.group, 0) <= 16 - 10
    else:
        assert out.usage.total_cached_tokens < FULL
        assert held["host"].get(alice.group, 0) < 10
    assert_no_leaks(engine)
    engine.close()
