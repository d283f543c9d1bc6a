"""HicacheTier driven by vLLM's own TieringOffloadingManager over a CPU primary tier (vllm_helpers.Engine): the
contract the offloading connector relies on, byte for byte, across restarts, faults, a full store, a rate limit
and many jobs at once; and its KV events through vLLM's own event classes."""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
import pytest
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadingKVEventsConfig, get_offload_block_hash

from hicache.config import ConfigError
from tests.integrations.vllm_helpers import BLOCK_BYTES, Engine, chunk_bytes, keys
from tiers.l3.format import L3Error

HIT, MISS = LookupResult.HIT, LookupResult.MISS


@pytest.fixture
def store_dir(tmp_path):
    return str(tmp_path / "l3")


def stored_and_evicted(engine: Engine, ks):
    """Store chunks through the primary tier, then push them out of it: what a later request finds only in the
    secondary tier."""
    engine.store(ks)
    engine.settle()
    engine.evict_primary()
    ctx = engine.request()
    with engine.manager.lock:
        assert all(engine.primary.lookup(k, ctx) is MISS for k in ks), "still in the primary tier"


def test_store_evict_lookup_load_back_byte_exact(store_dir):
    engine = Engine({"path": store_dir, "size_gib": 0.05})
    try:
        ks = keys(range(6))
        stored_and_evicted(engine, ks)
        assert engine.tier.chunks.store.used_pages() >= 6
        assert engine.lookup_all(ks) == [HIT] * 6
        for key, got in zip(ks, engine.read(ks)):
            assert np.array_equal(got, chunk_bytes(key))
        assert engine.lookup_all(keys([99])) == [MISS]
    finally:
        engine.close()


def test_a_restart_serves_the_same_keys(store_dir):
    ks = keys(range(5))
    first = Engine({"path": store_dir, "size_gib": 0.05})
    try:
        first.store(ks)
        first.settle()
    finally:
        first.close()
    second = Engine({"path": store_dir, "size_gib": 0.05})
    try:
        assert second.lookup_all(ks) == [HIT] * 5
        for key, got in zip(ks, second.read(ks)):
            assert np.array_equal(got, chunk_bytes(key))
    finally:
        second.close()


def test_another_configuration_never_reads_the_store(store_dir):
    first = Engine({"path": store_dir, "size_gib": 0.05})
    try:
        first.store(keys(range(3)))
        first.settle()
    finally:
        first.close()
    with pytest.raises(L3Error, match="dtype"):
        Engine({"path": store_dir, "size_gib": 0.05}, dtype="float16")
    with pytest.raises(L3Error, match="model"):
        Engine({"path": store_dir, "size_gib": 0.05}, model="org/other-model")


def test_a_flipped_byte_fails_that_chunk_alone(store_dir):
    ks = keys(range(4))
    first = Engine({"path": store_dir, "size_gib": 0.05})
    try:
        first.store(ks)
        first.settle()
        local = first.tier.chunks.local
        slot = local._entries[first.tier.store_key(ks[2])].slot
        offset = local._header.slot_offset(slot) + 1234
    finally:
        first.close()
    with open(os.path.join(store_dir, "slab-000.bin"), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    engine = Engine({"path": store_dir, "size_gib": 0.05})
    try:
        assert engine.lookup_all(ks) == [HIT, HIT, MISS, HIT]
        good = [ks[0], ks[1], ks[3]]
        for key, got in zip(good, engine.read(good)):
            assert np.array_equal(got, chunk_bytes(key))
        assert engine.tier.chunks.store.stats()["checksum_failures"] == 1
        assert engine.tier.lookup(ks[2], engine.request()) is MISS  # dropped from the store
    finally:
        engine.close()


def test_a_full_store_evicts_and_keeps_working(store_dir):
    capacity = 8
    size_gib = capacity * BLOCK_BYTES / (1 << 30)
    engine = Engine({"path": store_dir, "size_gib": size_gib}, primary_chunks=16)
    try:
        events = []
        for start in range(0, 24, 4):
            engine.store(keys(range(start, start + 4)))
            engine.settle()
            events += engine.tier.take_events()
        assert engine.tier.chunks.store.used_pages() == capacity
        removed = [k for e in events if e.removed for k in e.keys]
        stored = [k for e in events if not e.removed for k in e.keys]
        assert len(stored) == 24 and len(removed) == 24 - capacity
        assert set(removed) == set(keys(range(24 - capacity)))  # least recently stored first
        newest = keys(range(24 - capacity, 24))
        ctx = engine.request()
        assert [engine.tier.lookup(k, ctx) for k in newest] == [HIT] * capacity
        assert [engine.tier.lookup(k, ctx) for k in keys(range(4))] == [MISS] * 4
    finally:
        engine.close()


def test_the_write_rate_limit_holds(store_dir):
    limit_gbps = 0.02
    chunks = 160  # 10.5 MB: the bucket's 20 ms burst is under 4% of it
    engine = Engine({"path": store_dir, "size_gib": 0.05, "write_limit_gbps": limit_gbps}, primary_chunks=chunks)
    try:
        start = time.perf_counter()
        for i in range(0, chunks, 16):
            engine.store(keys(range(i, i + 16)))
        engine.settle(timeout=120)
        elapsed = time.perf_counter() - start
        written = engine.tier.chunks.store.stats()["write_bytes"]
        assert written == chunks * BLOCK_BYTES
        assert written / elapsed <= limit_gbps * 1e9 * 1.1  # the limit, within 10%
    finally:
        engine.close()


def test_many_jobs_in_flight(store_dir):
    engine = Engine({"path": store_dir, "size_gib": 0.05, "jobs_threads": 8}, primary_chunks=128)
    try:
        ks = keys(range(128))
        for i in range(0, 128, 2):  # 64 store jobs before any completes
            engine.store(ks[i:i + 2])
        assert len(engine.tier._jobs) > 1
        engine.settle()
        assert engine.tier.chunks.store.used_pages() == 128
        engine.evict_primary(filler=1 << 24)
        ctx = engine.request()
        with engine.manager.lock:  # 128 promotions at once, one load job per chunk
            assert {engine.manager.lookup(k, ctx) for k in ks} == {LookupResult.HIT_PENDING}
            engine.end_step()
        engine.finish(ctx)
        assert engine.lookup_all(ks) == [HIT] * 128
        for key, got in zip(ks, engine.read(ks)):
            assert np.array_equal(got, chunk_bytes(key))
    finally:
        engine.close()


def test_kv_events_decode_with_vllms_classes(store_dir):
    engine = Engine({"path": store_dir, "size_gib": 4 * BLOCK_BYTES / (1 << 30)})
    try:
        for batch in (range(4), range(4, 6)):  # four fit: the next two evict the first two
            engine.store(keys(batch))
            engine.settle()
        raw = [e for e in engine.manager.take_events() if e.medium is Medium.STORAGE]
        tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True,
                                                                   self_describing_kv_events=False))
        batch = KVEventBatch(ts=1.0, events=list(tracker.take_events(raw)))
        decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(msgspec.msgpack.Encoder().encode(batch))
        stored = [h for e in decoded.events if isinstance(e, BlockStored) for h in e.block_hashes]
        removed = [h for e in decoded.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert all(e.medium == MEDIUM_STORAGE for e in decoded.events)
        external = lambda ks: [maybe_convert_block_hash(get_offload_block_hash(k)) for k in ks]  # noqa: E731
        assert stored == external(keys(range(6)))
        assert sorted(removed) == sorted(external(keys(range(2))))
    finally:
        engine.close()


def test_remote_tier_only(valkey):
    tier = {"remote": {"url": valkey.url, "key_prefix": f"vllm-test-{os.getpid()}"}}
    engine = Engine(tier)
    try:
        ks = keys(range(5))
        stored_and_evicted(engine, ks)
        assert engine.lookup_all(ks) == [HIT] * 5
        for key, got in zip(ks, engine.read(ks)):
            assert np.array_equal(got, chunk_bytes(key))
    finally:
        engine.close()


@pytest.mark.parametrize("tier, message", [
    ({"size_gib": 1}, "give `path`"),
    ({"path": "/tmp/x"}, "size_gib: required"),
    ({"path": "/tmp/x", "size_gib": -1}, "size_gib: must be > 0"),
    ({"path": "/tmp/x", "size_gib": 1, "io_backend": "magic"}, "io_backend"),
    ({"path": "/tmp/x", "size_gib": 1, "colour": "blue"}, "unknown key 'colour'"),
    ({"remote": {"url": "http://nowhere"}}, "remote.url"),
])
def test_bad_options_name_the_key(tier, message):
    with pytest.raises(ConfigError, match=message):
        Engine(tier)


@pytest.mark.parametrize("cpus, threads", [(1, 4), (2, 4), (9, 4), (10, 5), (16, 8), (64, 8)])
def test_thread_counts_follow_the_cpus_the_process_may_use(monkeypatch, cpus, threads):
    from hicache.integrations import options

    monkeypatch.setattr(options.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    parsed = options.TierOptions.parse({"path": "/tmp/x", "size_gib": 1}, "test")
    assert (parsed.io_threads, parsed.jobs_threads) == (threads, threads)
    given = options.TierOptions.parse({"path": "/tmp/x", "size_gib": 1, "io_threads": 3, "jobs_threads": 2}, "test")
    assert (given.io_threads, given.jobs_threads) == (3, 2)
    with pytest.raises(ConfigError, match="io_threads: must be > 0"):
        options.TierOptions.parse({"path": "/tmp/x", "size_gib": 1, "io_threads": 0}, "test")


def test_metrics_go_through_vllms_hooks(store_dir):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    engine = Engine({"path": store_dir, "size_gib": 0.05})
    try:
        definitions = TieringOffloadingSpec.build_metric_definitions(engine.spec.extra_config)
        assert definitions["hicache:l3_write_bytes"].labelnames == ("tier",)
        assert "hicache:l3_used_chunks" in definitions
        engine.store(keys(range(3)))
        engine.settle()
        data = engine.manager.get_stats().data["data"]
        label = (engine.tier.tier_type,)
        assert data["hicache:l3_write_bytes"][label] == 3 * BLOCK_BYTES
        assert data["hicache:l3_used_chunks"][label] == 3
        engine.store(keys(range(3, 4)))
        engine.settle()
        data = engine.manager.get_stats().data["data"]
        assert data["hicache:l3_write_bytes"][label] == BLOCK_BYTES  # a counter's increase since the last call
        assert engine.tier.config_info()["hicache_path"] == store_dir
    finally:
        engine.close()
