"""Replay through the real controller against an independent per-tier LRU reference model."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from controller import WritePolicy
from hicache.replay.core import Replayer, ReplayError, ReplaySetup
from hicache.replay.trace import TraceRecord
from radix import DISK

TIERS = ("device", "host", "disk")
WRITE_THROUGH = WritePolicy.eager()


class ReferenceLRU:
    """Write-through + LRU as the docs state it, one OrderedDict per tier (oldest first).

    A hit walks the blocks in order, credits each to the fastest tier holding it and stops at the
    first block no tier holds. Then every block of the request goes to every tier, touched last to
    first (the first block ends most recent), and each tier keeps its most recent blocks.
    """

    def __init__(self, capacities: dict[str, int]):
        self.capacity = {t: c for t, c in capacities.items() if c > 0}
        self.tiers = {t: OrderedDict() for t in self.capacity}

    def request(self, ids: list[int]) -> list[str]:
        ids = ids[: self.capacity["device"]]  # a request uses at most the whole GPU tier
        hits = []
        for x in ids:
            tier = next((t for t in TIERS if t in self.tiers and x in self.tiers[t]), None)
            if tier is None:
                break
            hits.append(tier)
        for x in reversed(ids):
            for blocks in self.tiers.values():
                blocks[x] = None
                blocks.move_to_end(x)
        for t, blocks in self.tiers.items():
            while len(blocks) > self.capacity[t]:
                blocks.popitem(last=False)
        return hits


def random_trace(rng: random.Random, requests: int, max_len: int) -> list[list[int]]:
    """Prefix-chained id lists: a random cut of an earlier request plus fresh blocks."""
    out: list[list[int]] = []
    next_id = 0
    for _ in range(requests):
        prefix: list[int] = []
        if out and rng.random() < 0.8:
            base = rng.choice(out[-20:] if rng.random() < 0.7 else out)
            prefix = base[: rng.randint(0, len(base))]
        fresh = rng.randint(0 if prefix else 1, max(1, max_len - len(prefix)))
        ids = prefix + list(range(next_id, next_id + fresh))
        next_id += fresh
        out.append(ids[:max_len])
    return out


def records(traces: list[list[int]], block_tokens: int = 4) -> list[TraceRecord]:
    return [TraceRecord(float(i), len(ids) * block_tokens, 1, ids, i + 1) for i, ids in enumerate(traces)]


def compare(caps: dict[str, int], trace: list[list[int]], policy: str = "lru", residency: bool = True) -> None:
    setup = ReplaySetup(4, caps["device"], caps["host"], caps["disk"], block_bytes=64,
                        write_policy=WRITE_THROUGH, eviction_policy=policy)
    rep = Replayer(setup)
    ref = ReferenceLRU(caps)
    for i, rec in enumerate(records(trace)):
        out = rep.step(rec)
        want = ref.request(rec.hash_ids)
        got_hits = {t: n for t, n in out.hit_blocks.items() if n}
        want_hits = {t: want.count(t) for t in TIERS if want.count(t)}
        assert got_hits == want_hits, f"request {i} {rec.hash_ids}: hits {got_hits} != reference {want_hits}"
        assert out.disk_hit_positions == [p for p, t in enumerate(want) if t == "disk"]
        rep.check_integrity()
        got = rep.residency()
        for t in TIERS if residency else ():
            assert got[t] == set(ref.tiers.get(t, ())), f"request {i}: {t} holds {sorted(got[t])}"


CAPACITIES = [
    {"device": 6, "host": 12, "disk": 30},
    {"device": 10, "host": 10, "disk": 10},
    {"device": 8, "host": 20, "disk": 0},
    {"device": 16, "host": 0, "disk": 0},
    {"device": 6, "host": 9, "disk": 25},
]


@pytest.mark.parametrize("caps", CAPACITIES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("seed", range(6))
def test_write_through_lru_matches_reference(caps: dict[str, int], seed: int) -> None:
    rng = random.Random(seed * 1000 + sum(caps.values()))
    max_len = min(c for c in caps.values() if c)  # every request fits every tier
    compare(caps, random_trace(rng, 120, max_len))


@pytest.mark.parametrize("seed", range(4))
def test_requests_longer_than_gpu_match_reference(seed: int) -> None:
    """GPU only: a request keeps (and hits at most) its first device-capacity blocks."""
    compare({"device": 8, "host": 0, "disk": 0}, random_trace(random.Random(seed), 120, 14))


@pytest.mark.parametrize("seed", range(4))
def test_host_smaller_than_gpu_hits_match_reference(seed: int) -> None:
    """Host < GPU: hit counts agree; host contents differ (a GPU hit is not copied to host again)."""
    compare({"device": 12, "host": 6, "disk": 20}, random_trace(random.Random(seed), 120, 6), residency=False)


def test_hand_built_trace_known_answers() -> None:
    """Device 4 blocks, host 5, disk 8; write_through + LRU; answers worked out by hand."""
    setup = ReplaySetup(4, 4, 5, 8, block_bytes=64, write_policy=WRITE_THROUGH)
    rep = Replayer(setup)
    trace = [
        [1, 2, 3],  # cold: every tier holds 1 2 3
        [1, 2, 3],  # all on device
        [4, 5, 6],  # cold; recency 4 5 6 1 2 3: device 4 5 6 1, host 4 5 6 1 2, disk all six
        [1, 2, 3, 7],  # 1 device, 2 host, 3 disk, 7 new; device 1 2 3 7, host 1 2 3 7 4, disk all
        [4, 5, 6],  # 4 host, 5 6 disk
    ]
    expect = [{}, {"device": 3}, {}, {"device": 1, "host": 1, "disk": 1}, {"host": 1, "disk": 2}]
    for rec, want in zip(records(trace), expect):
        out = rep.step(rec)
        assert {t: n for t, n in out.hit_blocks.items() if n} == want
        assert sum(out.hit_tokens.values()) == 4 * sum(want.values())
        rep.check_integrity()
    assert rep.residency() == {"device": {4, 5, 6, 1}, "host": {4, 5, 6, 1, 2}, "disk": {1, 2, 3, 4, 5, 6, 7}}
    t = rep.totals
    assert (t.requests, t.blocks) == (5, 16)
    assert t.hit_blocks == {"device": 4, "host": 2, "disk": 3}
    assert t.requests_with_disk_hit == 2
    assert rep.store.pages_read == 3 and rep.store.pages_written == 7


def test_partial_last_block_tokens() -> None:
    rep = Replayer(ReplaySetup(4, 8))
    rep.step(TraceRecord(0.0, 10, 1, [1, 2, 3], 1))  # blocks of 4, 4, 2 tokens
    out = rep.step(TraceRecord(1.0, 10, 1, [1, 2, 3], 2))
    assert out.hit_blocks["device"] == 3 and out.hit_tokens["device"] == 10


def test_request_longer_than_gpu_caches_leading_blocks() -> None:
    rep = Replayer(ReplaySetup(4, 4, 0, 0))
    out = rep.step(TraceRecord(0.0, 24, 1, [1, 2, 3, 4, 5, 6], 1))
    assert out.not_cached == 2
    assert rep.residency()["device"] == {1, 2, 3, 4}
    out = rep.step(TraceRecord(1.0, 24, 1, [1, 2, 3, 4, 5, 6], 2))
    assert out.hit_blocks["device"] == 4 and out.not_cached == 2
    rep.check_integrity()


def test_disk_without_host_is_refused() -> None:
    with pytest.raises(ReplayError, match="host tier"):
        Replayer(ReplaySetup(512, 10, 0, 100))
    with pytest.raises(ReplayError, match="GPU tier"):
        Replayer(ReplaySetup(512, 0, 10, 0))


def multi_turn_trace(conversations: int, rounds: int, blocks_per_round: int) -> list[list[int]]:
    """Conversations taking turns in a fixed order; each turn resends its history plus new blocks."""
    out = []
    for r in range(rounds):
        for c in range(conversations):
            out.append([c * 1000 + i for i in range((r + 1) * blocks_per_round)])
    return out


def test_lrfu_keeps_conversations_that_lru_evicts_just_before_they_return() -> None:
    """6 conversations of up to 12 blocks outgrow a 12 + 24 block memory: LRU evicts each one just before its next
    turn; lrfu keeps a stable share of them in memory. The disk (recency-ranked under both) serves the rest."""
    trace = records(multi_turn_trace(6, 6, 2))
    hits = {}
    for policy in ("lru", "lrfu"):
        rep = Replayer(ReplaySetup(4, 12, 24, 400, block_bytes=64, write_policy=WRITE_THROUGH, eviction_policy=policy))
        totals = {t: 0 for t in TIERS}
        for rec in trace:
            for tier, n in rep.step(rec).hit_blocks.items():
                totals[tier] += n
            rep.check_integrity()
        hits[policy] = totals
    memory = {p: h["device"] + h["host"] for p, h in hits.items()}
    assert memory["lrfu"] >= 2 * max(1, memory["lru"])
    assert sum(hits["lrfu"].values()) == sum(hits["lru"].values())  # the disk holds it all: same total hits


def test_a_request_longer_than_the_l3_write_queue_reaches_the_disk_whole():
    """A 5,000-block prompt is one node, larger than the L3 worker's 4,096-page queue: it is written in parts, so
    when memory has forgotten it every block comes back from disk (it used to be refused whole and lost)."""
    setup = ReplaySetup(4, 6000, 6000, 20000, block_bytes=64, write_policy=WRITE_THROUGH)
    rep = Replayer(setup)
    long = list(range(1, 5001))
    rep.step(TraceRecord(0.0, len(long) * 4, 1, long, 1))
    assert rep.store.pages_written == 5000
    for i in range(2, 4):  # 12,000 other blocks: the long prompt leaves GPU and host
        ids = list(range(i * 100_000, i * 100_000 + 6000))
        rep.step(TraceRecord(float(i), len(ids) * 4, 1, ids, i))
    out = rep.step(TraceRecord(9.0, len(long) * 4, 1, long, 9))
    assert out.hit_blocks.get("disk", 0) == 5000
    rep.check_integrity()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_lru_inclusive_preset_agrees_with_the_reference_block_for_block(tmp_path, seed):
    """`hicache replay --policy lru-inclusive` (the command, not the library) against the independent inclusive LRU."""
    import json
    import random

    from hicache.cli import main

    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 10**6) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    traces = [rng.choice(prefixes)[: rng.randrange(1, 12)] + [rng.randrange(10**6, 2 * 10**6)
                                                          for _ in range(rng.randrange(0, 4))] for _ in range(80)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": len(ids) * 512, "output_length": 1,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(traces)))
    caps = {"device": 12, "host": 24, "disk": 60}
    out = tmp_path / "r.json"
    assert main(["replay", str(path), "--no-time", "--policy", "lru-inclusive",
                 "--device-tokens", str(caps["device"] * 512), "--host-tokens", str(caps["host"] * 512),
                 "--disk-tokens", str(caps["disk"] * 512),
                 "--kv-bytes-per-token", "64", "--no-progress", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    ref = ReferenceLRU(caps)
    want = {t: 0 for t in TIERS}
    for ids in traces:
        for tier in ref.request(ids):
            want[tier] += 1
    assert got["hit_blocks"] == want
    assert got["policies"]["host_to_disk"] == "write_through" and got["policies"]["defer_above_free"] == 1.0


def test_requests_longer_than_the_gpu_tier_are_counted_with_the_blocks_they_cost():
    rep = Replayer(ReplaySetup(4, 8, 0, 0, block_bytes=64))
    rep.step(TraceRecord(0.0, 12 * 4, 1, list(range(1, 13)), 1))  # 12 blocks, 8 fit the GPU tier
    rep.step(TraceRecord(1.0, 4 * 4, 1, list(range(20, 24)), 2))
    assert rep.totals.cut_requests == 1 and rep.totals.not_cached_blocks == 4


def test_the_lru_inclusive_preset_agrees_with_the_reference_on_agent_sessions(tmp_path):
    """The same agreement on the agent-session format: two sessions whose turns extend their context."""
    import json
    import random

    from hicache.cli import main
    from hicache.replay.agent import read_agent_sessions

    rng = random.Random(5)
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    for name in ("s1", "s2"):
        ids, requests = [], []
        for turn in range(8):
            ids = ids + [rng.randrange(1, 10**6) for _ in range(rng.randrange(1, 5))]
            requests.append({"t": float(turn * 7 + (name == "s2")), "in": 64 * len(ids), "out": 4, "hash_ids": ids})
        (sessions / f"{name}.json").write_text(json.dumps({"id": name, "block_size": 64, "requests": requests}))
    caps = {"device": 8, "host": 16, "disk": 40}
    out = tmp_path / "r.json"
    assert main(["replay", str(sessions), "--no-time", "--policy", "lru-inclusive",
                 "--device-tokens", str(caps["device"] * 64), "--host-tokens", str(caps["host"] * 64),
                 "--disk-tokens", str(caps["disk"] * 64),
                 "--kv-bytes-per-token", "64", "--no-progress", "--json", str(out)]) == 0
    ref = ReferenceLRU(caps)
    want = {t: 0 for t in TIERS}
    for rec in read_agent_sessions([sessions]).records:
        for tier in ref.request(rec.hash_ids):
            want[tier] += 1
    got = json.loads(out.read_text())["hit_blocks"]
    assert got == want and sum(want.values()) > 0


def test_a_replay_decides_the_same_whatever_its_metadata_calls_take(monkeypatch) -> None:
    """With the cost model on (load mode auto, a slow disk near the break-even), a replay must not follow the
    measured time of its store calls, as the server follows its disk: those calls are metadata, and the outcome
    would change from run to run with the machine's load."""
    import time

    from hicache.replay.store import ReplayL3

    trace = random_trace(random.Random(5), 120, 12)
    setup = ReplaySetup(4, 6, 10, 60, block_bytes=4 << 20, load_mode="auto", prefill_tokens_per_s=4000.0,
                        host_to_device_bytes_per_s=50e9, disk_to_device_bytes_per_s=4.2e9,
                        write_policy=WRITE_THROUGH)
    quick = Replayer(setup).run(records(trace))
    real_read = ReplayL3.read_pages

    def slow_read(self, keys, out):
        time.sleep(0.002)  # a loaded box: 2 ms per metadata read
        return real_read(self, keys, out)

    monkeypatch.setattr(ReplayL3, "read_pages", slow_read)
    slow = Replayer(setup).run(records(trace))
    assert quick.hit_blocks[DISK] > 0
    assert slow.hit_blocks == quick.hit_blocks and slow.matched_not_served_blocks == quick.matched_not_served_blocks


def test_each_request_is_a_step_that_renews_the_slice_of_deferred_backups() -> None:
    """GPU -> host copies deferred while more than half of the GPU is free start in slices of FLUSH_SLICE_BYTES a
    step once it fills (controller/writes.py), as on the server, where every engine step renews the slice. 512 MiB
    blocks: a slice of 2 blocks (whole nodes: one node of 3); 20 GPU blocks; a node of 3 new blocks a request. From
    the fourth request (12 blocks used) a request's own node is copied at commit and one waiting node more starts,
    until none waits (6 host pages more a request): without a new slice per request the backlog stalled after the
    first (host pages 0, 0, 0, 6, 9, 12)."""
    policy = WritePolicy("write_through", "write_through", defer_above_free=0.5)
    rep = Replayer(ReplaySetup(4, 20, host_blocks=100, block_bytes=1 << 29, write_policy=policy))
    host_used, waiting = [], []
    for i in range(6):
        rep.step(TraceRecord(float(i), 12, 1, [100 * i + j for j in range(3)], 1))
        host_used.append(100 - rep.controller.host.allocator.free_pages)
        waiting.append(len(rep.controller.writes.deferred))
    assert host_used == [0, 0, 0, 6, 12, 18]
    assert waiting == [1, 2, 3, 2, 1, 0]
