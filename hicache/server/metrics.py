"""Prometheus metrics of the server: cache counters and tier usage from engine stats, request histograms.

Cache figures are read at scrape time from an engine stats snapshot (see `Engine.stats`) and the L3
store's `stats()`; request figures (TTFT, latency, finish reasons) are observed by the HTTP handlers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from controller.stats import HIT_TIERS
from hicache import gc_stats
from radix import DEVICE, DISK, HOST, TIERS

PROMOTIONS = ((HOST, DEVICE), (DISK, HOST), (DISK, DEVICE))
DEMOTIONS = ((DEVICE, HOST), (HOST, DISK), (DEVICE, DISK))
REMOTE_STATES = ("ok", "down", "auth_failed", "disabled")
REMOTE_COUNTERS = ("reads", "read_bytes", "hits", "misses", "vanished", "bad_values", "bad_deleted", "writes",
                   "write_bytes", "write_refused", "not_admitted", "full", "probes", "probe_hits", "errors",
                   "reconnects")
L3_STATES = ("ok", "probing", "degraded", "read_only", "gone", "disabled")
# the faults among them (short reads: a slab cut short under the store; index resets and dropped entries: an index
# found damaged or pointing past the slab at open or reopen) are what an operator alerts on
L3_COUNTERS = ("writes", "write_bytes", "reads", "read_bytes", "hits", "misses", "checksum_failures",
               "short_reads", "read_errors", "write_errors", "write_refused", "evictions", "fsyncs", "index_resets",
               "dropped_entries")
# latency buckets in seconds, from 1 ms (a GPU prefix hit) to minutes (a long queue)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# scalar counters: (metric name, help, key in the engine stats' "cache" or "engine" dict)
CACHE_COUNTERS = (
    ("hicache_prompt_tokens", "Prompt tokens matched against the cache (per admission)", "prompt_tokens"),
    ("hicache_l3_load_failures", "L3 reads that missed or failed verification", "load_failures"),
    ("hicache_l3_prefetched_pages", "L3 -> host reads started for queued requests", "prefetched_pages"),
    ("hicache_staged_pages", "Host -> GPU copies started for queued requests, before their admission",
     "staged_pages"),
    ("hicache_l3_gave_up_reads", "Requests that stopped waiting for disk reads at their deadline (as long as "
     "recomputing would take) and computed those pages instead", "gave_up_reads"),
    ("hicache_deferred_backup_pages", "New GPU pages whose write-through copy to host waited for memory pressure "
     "or idle", "deferred_pages"),
    ("hicache_eviction_backup_pages", "GPU pages copied to host as they were evicted (the compute stream waits "
     "for them)", "eviction_backups"),
    ("hicache_backup_wait_pages", "GPU pages freed while their copy to host was still in flight (the compute stream "
     "waited for it)", "backup_waits"),
    ("hicache_host_free_wait_seconds", "Seconds the engine thread waited for copies landing in freed host pages, "
     "when the host tier had no other room", "host_free_wait_s"),
)
ENGINE_COUNTERS = (
    ("hicache_engine_steps", "Engine forward steps", "steps"),
    ("hicache_engine_graph_steps", "Decode steps replayed from a CUDA graph", "graph_steps"),
    ("hicache_engine_forward_seconds", "Seconds in forward passes and sampling", "forward_s"),
    ("hicache_engine_schedule_seconds", "Seconds planning steps and committing their pages (scheduler and cache "
     "controller)", "schedule_s"),
    ("hicache_engine_schedule_overlapped_seconds", "The part of the scheduling seconds spent after a forward was "
     "queued (starting loads, admit_during_forward), while the GPU computes", "overlapped_s"),
    ("hicache_engine_prefill_steps", "Forward steps with prompt tokens", "prefill_steps"),
    ("hicache_engine_prefill_schedule_seconds", "Scheduling seconds of the steps with prompt tokens, less what "
     "overlapped their forwards: what such a step costs besides its forward (the replay's step cost)",
     "prefill_schedule_s"),
    ("hicache_computed_prefill_tokens", "Prompt tokens computed (not served by cache)", "prefill_tokens"),
    ("hicache_computed_decode_tokens", "Tokens decoded", "decode_tokens"),
    ("hicache_tp_plans", "Plans rank 0 sent to the other tensor-parallel ranks (0 without tensor parallelism)",
     "tp_plans"),
    ("hicache_tp_ops", "Byte moves (copies, L3 reads, writes, deletes) those plans carried", "tp_ops"),
)


def decode_step_fit(counters: dict[str, Any]) -> tuple[float, float] | None:
    """(seconds, seconds per sequence) of a decode-only step: a least-squares line through the engine's decode-only
    steps (hicache.engine.instruments.StepTimes counts them); None before the first. With one batch size seen, or
    a line falling with it, the mean step time and 0 per sequence. A replay's time model prices decoding with it
    (hicache/replay/simulate.py)."""
    n = counters.get("decode_steps", 0)
    if not n:
        return None
    x, y = counters["decode_step_seqs"], counters["decode_step_s"]
    xx, xy = counters["decode_step_seqs2"], counters["decode_step_seq_s"]
    spread = n * xx - x * x
    slope = (n * xy - x * y) / spread if spread > 0 else 0.0
    if slope <= 0:
        return y / n, 0.0
    base = (y - slope * x) / n
    if base < 0:  # the line would cross zero: all of it per sequence
        return 0.0, xy / xx
    return base, slope


def _pair_counter(name: str, doc: str, values: dict[str, int], pairs: tuple[tuple[str, str], ...]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=["src", "dst"])
    seen = {f"{s}->{d}" for s, d in pairs}
    for s, d in pairs:
        family.add_metric([s, d], values.get(f"{s}->{d}", 0))
    for key, value in sorted(values.items()):  # any pair not listed above
        if key not in seen:
            s, _, d = key.partition("->")
            family.add_metric([s, d], value)
    return family


class CacheCollector:
    """Turns the latest engine stats and L3 stats into metric families (set them before each scrape)."""

    def __init__(self, page_bytes: int, group_names: dict[int, str] | None = None):
        self.page_bytes = page_bytes
        self.group_names = group_names or {0: "default"}  # share group -> tenant label (never a key or salt)
        self.stats: dict[str, Any] = {}
        self.l3: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        cache = s.get("cache", {})
        hits = CounterMetricFamily("hicache_cache_hit_tokens", "Prompt tokens served from each tier's cache",
                                   labels=["tier"])
        for tier in HIT_TIERS:
            hits.add_metric([tier], cache.get("hit_tokens", {}).get(tier, 0))
        yield hits
        recomputed = CounterMetricFamily("hicache_recomputed_tokens", "Cached tokens recomputed because loading cost "
                                         "more (or their disk reads were given up), by the tier they were in",
                                         labels=["tier"])
        for tier in HIT_TIERS:
            recomputed.add_metric([tier], cache.get("recomputed_by_tier", {}).get(tier, 0))
        yield recomputed
        yield _pair_counter("hicache_pages_promoted", "Pages copied to a faster tier",
                            cache.get("pages_promoted", {}), PROMOTIONS)
        yield _pair_counter("hicache_pages_demoted", "Pages copied to a slower tier", cache.get("pages_demoted", {}),
                            DEMOTIONS)
        yield _pair_counter("hicache_bytes_moved", "KV bytes copied between tiers", cache.get("bytes_moved", {}),
                            PROMOTIONS + DEMOTIONS)
        evictions = CounterMetricFamily("hicache_evictions", "Pages dropped from a tier", labels=["tier"])
        for tier in TIERS:
            evictions.add_metric([tier], cache.get("evictions", {}).get(tier, 0))
        yield evictions
        drops = CounterMetricFamily("hicache_dropped_pages", "Pages not backed up or not loaded, by reason",
                                    labels=["reason"])
        for reason, n in sorted(cache.get("drops", {}).items()):
            drops.add_metric([reason], n)
        yield drops
        for name, doc, key in CACHE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=cache.get(key, 0))
        yield GaugeMetricFamily("hicache_l3_write_waiting_pages", "Pages in host memory whose L3 write waits for room "
                                "in the write queue", value=cache.get("l3_write_waiting_pages", 0))
        yield from self._tiers(s.get("tiers", {}))
        yield self._tenant_pages(s.get("group_pages", {}))
        yield from self._cost(s.get("cost_model", {}))
        yield from self._l3()
        yield from self._scheduler(s)

    def _tenant_pages(self, group_pages: dict[str, dict[int, int]]) -> Metric:
        """Pages each tenant's namespaces hold per tier (the shared namespace's as "shared"): what the tenants'
        shares of the tiers are measured against."""
        family = GaugeMetricFamily("hicache_tenant_cache_pages", "Cached pages per tenant and tier",
                                   labels=["tenant", "tier"])
        for tier in TIERS:
            held = group_pages.get(tier, {})
            for group, name in sorted(self.group_names.items()):
                family.add_metric([name, tier], held.get(group, 0))
        return family

    def _cost(self, cost: dict[str, Any]) -> Iterator[Metric]:
        """The load-or-recompute model's inputs as the planner sees them now (the disk's follows measured reads)."""
        yield GaugeMetricFamily("hicache_cost_prefill_tokens_per_second", "Prefill speed the cost model prices "
                                "recompute at (a token at the start of a prompt; 0: unknown)",
                                value=cost.get("prefill_tokens_per_s") or 0)
        yield GaugeMetricFamily("hicache_cost_attention_ns_per_pair", "Prefill nanoseconds per (token, earlier token) "
                                "pair: what each token of context adds to a token's recompute cost",
                                value=cost.get("attention_ns_per_pair") or 0)
        bandwidth = GaugeMetricFamily("hicache_cost_load_gbps", "Load bandwidth to the GPU the cost model uses, per "
                                      "tier (0: unknown, counted as free)", labels=["tier"])
        bandwidth.add_metric([HOST], cost.get("host_to_device_gbps") or 0)
        bandwidth.add_metric([DISK], cost.get("disk_to_device_gbps") or 0)
        yield bandwidth
        first = cost.get("disk_pays_from_token", 0)
        yield GaugeMetricFamily("hicache_cost_disk_pays_from_token", "The first prompt position from which loading "
                                "a disk page beats recomputing it (-1: none)", value=-1 if first is None else first)

    def _tiers(self, tiers: dict[str, dict[str, int]]) -> Iterator[Metric]:
        families = {
            "used_pages": GaugeMetricFamily("hicache_tier_used_pages", "Pages in use per tier", labels=["tier"]),
            "capacity_pages": GaugeMetricFamily("hicache_tier_capacity_pages", "Capacity per tier in pages",
                                                labels=["tier"]),
            "used_bytes": GaugeMetricFamily("hicache_tier_used_bytes", "KV bytes in use per tier", labels=["tier"]),
            "capacity_bytes": GaugeMetricFamily("hicache_tier_capacity_bytes", "Capacity per tier in bytes",
                                                labels=["tier"]),
        }
        for tier in TIERS:
            usage = tiers.get(tier, {"used": 0, "capacity": 0})  # a disabled tier has capacity 0
            families["used_pages"].add_metric([tier], usage["used"])
            families["capacity_pages"].add_metric([tier], usage["capacity"])
            families["used_bytes"].add_metric([tier], usage["used"] * self.page_bytes)
            families["capacity_bytes"].add_metric([tier], usage["capacity"] * self.page_bytes)
        yield from families.values()

    def _l3(self) -> Iterator[Metric]:
        l3 = self.l3
        yield _state_gauge("hicache_l3_state", "L3 store state (1 for the current one)", L3_STATES,
                           l3["state"] if l3 else "disabled")
        backend = GaugeMetricFamily("hicache_l3_io_backend", "The L3 store's I/O path (1 for the active one)",
                                    labels=["backend"])
        backend.add_metric([l3["io_backend"] if l3 else "none"], 1.0)
        yield backend
        if l3:
            ops = CounterMetricFamily("hicache_l3_operations", "L3 store counters", labels=["op"])
            for name in L3_COUNTERS:
                ops.add_metric([name], l3.get(name, 0))
            yield ops
            limit = GaugeMetricFamily("hicache_l3_rate_limit_gbps", "The store's bandwidth cap in GB/s (0: none; "
                                      "cache.l3.read_limit_gbps / write_limit_gbps)", labels=["direction"])
            waited = CounterMetricFamily("hicache_l3_rate_limit_wait_seconds", "Seconds the store's I/O threads "
                                         "slept to keep to its bandwidth cap", labels=["direction"])
            for direction in ("read", "write"):
                limit.add_metric([direction], l3.get(f"{direction}_limit_gbps", 0.0))
                waited.add_metric([direction], l3.get(f"{direction}_limit_wait_s", 0.0))
            yield limit
            yield waited
            if "restarts" in l3:  # the store runs in a process of its own (tiers/l3/process.py)
                yield CounterMetricFamily("hicache_l3_process_restarts", "L3 processes started again after one died",
                                          value=l3["restarts"])
                yield CounterMetricFamily("hicache_l3_process_call_seconds", "Seconds callers (the engine thread) "
                                          "waited for the L3 process to answer store calls",
                                          value=l3.get("call_seconds", 0))
                yield CounterMetricFamily("hicache_l3_process_calls", "Store calls the L3 process answered",
                                          value=l3.get("calls", 0))
                yield GaugeMetricFamily("hicache_l3_process_slowest_call_seconds", "The slowest answer so far",
                                        value=l3.get("slowest_call_s", 0))
        remote = (l3 or {}).get("remote")
        yield _state_gauge("hicache_remote_state", "Remote tier state (1 for the current one)", REMOTE_STATES,
                           remote["state"] if remote else "disabled")
        if remote:
            ops = CounterMetricFamily("hicache_remote_operations", "Remote tier counters", labels=["op"])
            for name in REMOTE_COUNTERS:
                ops.add_metric([name], remote.get(name, 0))
            yield ops

    def _scheduler(self, s: dict[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily("hicache_queue_depth", "Requests waiting for admission or for their prefix to load",
                                value=s.get("queue_depth", 0))
        requests = GaugeMetricFamily("hicache_num_requests", "Requests in the engine by state", labels=["state"])
        for state, n in sorted(s.get("requests", {}).items()):
            requests.add_metric([state], n)
        yield requests
        yield CounterMetricFamily("hicache_preemptions", "Requests preempted for GPU pages",
                                  value=s.get("preemptions", 0))
        engine = s.get("engine", {})
        for name, doc, key in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=engine.get(key, 0))
        base, per_sequence = decode_step_fit(engine) or (0.0, 0.0)
        yield GaugeMetricFamily("hicache_cost_decode_step_seconds", "Wall seconds of a decode-only step, less its "
                                "sequences' share (a line fit through the steps so far; 0: none yet)", value=base)
        yield GaugeMetricFamily("hicache_cost_decode_seconds_per_sequence", "What each sequence adds to a decode-only "
                                "step's wall seconds (the same fit)", value=per_sequence)


class GcCollector:
    """Python's garbage collector, read at scrape time (`hicache.gc_stats`): a long collection stalls the engine."""

    def collect(self) -> Iterator[Metric]:
        g = gc_stats.snapshot()
        collections = CounterMetricFamily("hicache_gc_collections", "Garbage collections by generation",
                                          labels=["generation"])
        for generation, n in enumerate(g["collections"]):
            collections.add_metric([str(generation)], n)
        yield collections
        yield CounterMetricFamily("hicache_gc_seconds", "Seconds spent in garbage collection (the GIL is held)",
                                  value=g["seconds"])
        yield GaugeMetricFamily("hicache_gc_longest_pause_seconds", "The longest single garbage collection",
                                value=g["longest_s"])
        yield GaugeMetricFamily("hicache_gc_frozen_objects", "Objects moved out of garbage collection at startup "
                                "(gc.freeze)", value=g["frozen"])


class ServerMetrics:
    """The server's registry: the cache collector plus request histograms and counters."""

    def __init__(self, page_bytes: int, group_names: dict[int, str] | None = None,
                 tenant_names: tuple[str, ...] = ("default",)):
        self.registry = CollectorRegistry(auto_describe=False)
        self._render_lock = threading.Lock()
        self.version = 0  # bumped as a request starts and finishes (generation._Tracker): /metrics renders anew
        self.cache = CacheCollector(page_bytes, group_names)
        self.registry.register(self.cache)
        self.registry.register(GcCollector())
        r = self.registry
        self.ttft = Histogram("hicache_time_to_first_token_seconds", "Time from request arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("hicache_e2e_request_latency_seconds", "Time from request arrival to its end",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("hicache_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.request_prompt_tokens = Counter("hicache_request_prompt_tokens", "Prompt tokens of finished requests",
                                             registry=r)
        self.request_cached_tokens = Counter("hicache_request_cached_tokens",
                                             "Prompt tokens of finished requests served from each tier", ["tier"],
                                             registry=r)
        self.tenant_prompt_tokens = Counter("hicache_tenant_prompt_tokens", "Prompt tokens of finished requests "
                                            "per tenant", ["tenant"], registry=r)
        self.tenant_cached_tokens = Counter("hicache_tenant_cached_tokens", "Prompt tokens of finished requests "
                                            "served from each tier, per tenant", ["tenant", "tier"], registry=r)
        self.generation_tokens = Counter("hicache_generation_tokens", "Tokens generated", registry=r)
        self.in_flight = Gauge("hicache_http_requests_in_flight", "Generation requests being served", registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(reason)
        for tier in TIERS:
            self.request_cached_tokens.labels(tier)
        for tenant in tenant_names:
            self.tenant_prompt_tokens.labels(tenant)
            for tier in TIERS:
                self.tenant_cached_tokens.labels(tenant, tier)

    def render(self, stats: dict[str, Any], l3: dict[str, Any] | None, tenant_series: bool = True) -> bytes:
        """The exposition text for these stats; without `tenant_series`, the per-tenant families
        (`hicache_tenant_*`) are left out."""
        with self._render_lock:  # scrapes render in worker threads, and the collector holds one scrape's stats
            self.cache.stats, self.cache.l3 = stats, l3
            text = generate_latest(self.registry)
        if tenant_series:
            return text
        return b"".join(line for line in text.splitlines(keepends=True) if not _tenant_line(line))


TENANT_PREFIX = b"hicache_tenant_"


def _tenant_line(line: bytes) -> bool:
    """Whether an exposition line belongs to a per-tenant family: its samples, and its HELP and TYPE lines."""
    if line.startswith(b"# "):
        parts = line.split(b" ", 3)
        return len(parts) > 2 and parts[2].startswith(TENANT_PREFIX)
    return line.startswith(TENANT_PREFIX)


def _state_gauge(name: str, doc: str, states: tuple[str, ...], state: str) -> GaugeMetricFamily:
    """One gauge per known state (and the current one, if unknown), 1 for the current one."""
    family = GaugeMetricFamily(name, doc, labels=["state"])
    for s in sorted(set(states) | {state}):
        family.add_metric([s], 1.0 if s == state else 0.0)
    return family
