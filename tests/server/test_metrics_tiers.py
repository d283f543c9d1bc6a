"""The L3 and remote-tier metric families from the stats they are given (hicache/server/metrics.py)."""

from __future__ import annotations

from hicache.server.metrics import CacheCollector


def _families(l3):
    collector = CacheCollector(page_bytes=4096)
    collector.stats = {"cache": {"hit_tokens": {"disk": 64, "remote": 128}, "l3_write_waiting_pages": 5}}
    collector.l3 = l3
    return {f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in collector.collect()}


def test_a_process_l3_with_a_shared_tier_behind_it():
    l3 = {"state": "ok", "io_backend": "posix", "writes": 5, "restarts": 2, "process": 123, "call_seconds": 1.5,
          "calls": 40, "slowest_call_s": 0.3, "remote": {"state": "down", "hits": 7, "bad_values": 1}}
    f = _families(l3)
    assert f["hicache_l3_state"][("ok",)] == 1.0 and f["hicache_l3_state"][("gone",)] == 0.0
    assert f["hicache_l3_process_restarts"][()] == 2
    assert f["hicache_l3_process_call_seconds"][()] == 1.5 and f["hicache_l3_process_calls"][()] == 40
    assert f["hicache_l3_process_slowest_call_seconds"][()] == 0.3
    assert f["hicache_remote_state"][("down",)] == 1.0 and f["hicache_remote_state"][("ok",)] == 0.0
    assert f["hicache_remote_operations"][("hits",)] == 7 and f["hicache_remote_operations"][("bad_values",)] == 1
    assert f["hicache_cache_hit_tokens"][("remote",)] == 128 and f["hicache_cache_hit_tokens"][("disk",)] == 64
    assert f["hicache_l3_write_waiting_pages"][()] == 5


def test_the_l3_faults_an_operator_alerts_on_are_counted():
    l3 = {"state": "ok", "io_backend": "posix", "short_reads": 3, "index_resets": 1, "dropped_entries": 81,
          "write_refused": 4, "remote": {"state": "ok", "bad_values": 2, "bad_deleted": 2}}
    ops = _families(l3)["hicache_l3_operations"]
    assert (ops[("short_reads",)], ops[("index_resets",)], ops[("dropped_entries",)], ops[("write_refused",)]) == (
        3, 1, 81, 4)
    assert _families(l3)["hicache_remote_operations"][("bad_deleted",)] == 2


def test_no_l3_and_no_shared_tier():
    f = _families(None)
    assert f["hicache_l3_state"][("disabled",)] == 1.0 and f["hicache_remote_state"][("disabled",)] == 1.0
    assert "hicache_l3_process_restarts" not in f and "hicache_remote_operations" not in f


def test_cost_model_gauges_from_its_description():
    from controller import CostModel

    cost = CostModel(64, 8 << 20, "auto", 40000.0, 55e9, 2e9, attention_seconds_per_pair=8.76e-10)
    collector = CacheCollector(page_bytes=8 << 20)
    collector.stats = {"cost_model": cost.describe()}
    f = {f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in collector.collect()}
    assert f["hicache_cost_prefill_tokens_per_second"][()] == 40000.0
    assert f["hicache_cost_attention_ns_per_pair"][()] == 0.876
    assert f["hicache_cost_load_gbps"] == {("host",): 55.0, ("disk",): 2.0}
    assert f["hicache_cost_disk_pays_from_token"][()] == cost.pays_from_token("disk") == 46272
    collector.stats = {}  # before the first stats snapshot
    f = {f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in collector.collect()}
    assert f["hicache_cost_prefill_tokens_per_second"][()] == 0 and f["hicache_cost_disk_pays_from_token"][()] == 0
