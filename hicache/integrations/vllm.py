"""hicache's disk and shared tiers as a secondary tier of vLLM's KV offloading (`TieringOffloadingSpec`).

vLLM keeps offloaded KV chunks in a CPU primary tier and cascades each one it stores to its secondary tiers; a
chunk found only in a secondary tier is loaded back into the primary tier before the GPU reads it. `HicacheTier`
is such a tier, loaded by class name and module path, with no change to vLLM:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 34359738368,
        "secondary_tiers": [{"type": "HicacheTier", "module_path": "hicache.integrations.vllm",
                             "path": "/nvme/hicache", "size_gib": 512}]}}'

Its other keys are `TierOptions`' (hicache/integrations/options.py; docs/integrations.md). All of its methods
run in vLLM's scheduler, under the tiering manager's lock, and none waits for the disk: stores and loads are
queued to an L3Worker (a writer thread that groups stores into synced batches, reader threads for loads) and
reported by `get_finished_jobs`. A chunk whose record fails its checksum is left out of a load's
`successful_keys` (vLLM recomputes it) and dropped from the store.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, JobResult, SecondaryTierManager, TransferJob

from hicache.integrations.chunks import ChunkStore, byte_rows, chunk_key, handled
from hicache.integrations.options import TierOptions
from tiers.l3.worker import L3Worker

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

# counters of the L3 store and of the remote tier exported as vLLM metrics, as their deltas between get_stats calls
STORE_COUNTERS = {
    "hicache:l3_read_bytes": ("read_bytes", "Bytes read from hicache's L3 store into the primary tier."),
    "hicache:l3_write_bytes": ("write_bytes", "Bytes written to hicache's L3 store."),
    "hicache:l3_checksum_failures": ("checksum_failures",
                                     "Chunks whose L3 record failed its checksum: not loaded, dropped, recomputed."),
    "hicache:l3_evictions": ("evictions", "Chunks evicted from hicache's L3 store to make room."),
    "hicache:l3_write_errors": ("write_errors", "Chunks an I/O error kept from the L3 store."),
    "hicache:l3_not_admitted": ("not_admitted", "Chunks the admission rule kept out of the L3 store."),
}
REMOTE_COUNTERS = {
    "hicache:remote_read_bytes": ("read_bytes", "Bytes read from hicache's shared tier."),
    "hicache:remote_bad_values": ("bad_values", "Shared-tier values that failed their checksum (misses)."),
}
USED_CHUNKS = "hicache:l3_used_chunks"
QUEUE_REFUSED = "hicache:store_jobs_refused"


@dataclass
class _Job:
    keys: list[OffloadKey]
    store_keys: list[bytes]
    is_load: bool


class _RemoteLookups(AsyncLookupManager):
    """Probes of the shared tier off the scheduler thread (a network round trip each batch)."""

    def __init__(self, tier: HicacheTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        store = self._tier.chunks
        return store.remote.contains([self._tier.store_key(k, req_context) for k in keys])


class HicacheTier(SecondaryTierManager):
    """hicache's L3 store (and shared tier) as a vLLM secondary tier; see the module doc."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, locality: str | None = None,
                 **options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        source = f"secondary tier {tier_type!r}"
        self.options = TierOptions.parse(options, source)
        config = offloading_spec.config
        self.chunks = ChunkStore(self.options, self.block_size_bytes, vllm_identity(offloading_spec),
                                 vllm_store_part(config.parallel), source)
        self._rows = byte_rows(primary_kv_view)
        self._worker = L3Worker(self.chunks.store, threads=self.options.jobs_threads,
                                queue_pages=self.options.queue_chunks, batch_pages=self.chunks.sync_batch_chunks,
                                read_batch_bytes=self.options.read_batch_mib << 20)
        self._jobs: dict[int, _Job] = {}
        self._writing: dict[bytes, int] = {}  # store key -> store jobs writing it
        self._finished: list[JobResult] = []
        self._names: dict[bytes, OffloadKey] = {}  # store key -> vLLM key, for the events of later evictions
        self._events: list[OffloadingEvent] | None = (
            [] if offloading_spec.kv_events_config.enable_kv_cache_events else None)
        self._counters_seen: dict[str, int] = {}
        self._refused = 0
        self._remote_lookups = _RemoteLookups(self) if self.chunks.remote is not None else None

    # ---- keys

    def store_key(self, key: OffloadKey, req_context: ReqContext | None = None) -> bytes:
        """The store's key of a vLLM key. vLLM's block hashes already cover a request's cache salt, so the key
        alone names the chunk."""
        return chunk_key(bytes(key))

    def _chunk(self, chunk_id: Any) -> Any:
        start = int(chunk_id) * self.block_size_bytes
        return self._rows[start:start + self.block_size_bytes]

    # ---- SecondaryTierManager

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        k = self.store_key(key, req_context)
        if k in self._writing:
            return LookupResult.RETRY  # being stored: readable once its job reports
        if self.chunks.contains_local([k])[0]:
            self._names[k] = key
            return LookupResult.HIT
        if self._remote_lookups is None:
            return LookupResult.MISS
        found = self._remote_lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.chunks.store.note_hit([self.store_key(k, req_context) for k in keys])

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        store_keys = [self.store_key(k, job_metadata.req_context) for k in keys]
        pages = [self._chunk(c) for c in job_metadata.chunk_ids]
        job_id = job_metadata.job_id
        if not self._worker.submit_write(job_id, store_keys, pages):
            self._refused += 1
            self._finished.append(JobResult(job_id=job_id, success=False))
            return
        self._jobs[job_id] = _Job(keys, store_keys, is_load=False)
        for k in store_keys:
            self._writing[k] = self._writing.get(k, 0) + 1

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        store_keys = [self.store_key(k, job_metadata.req_context) for k in keys]
        pages = [self._chunk(c) for c in job_metadata.chunk_ids]
        self._jobs[job_metadata.job_id] = _Job(keys, store_keys, is_load=True)
        self._worker.submit_read(job_metadata.job_id, store_keys, pages)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self._finished = self._finished, []
        for done in self._worker.completions():
            job = self._jobs.pop(done.token)
            nbytes = len(job.keys) * self.block_size_bytes
            if job.is_load:
                finished.append(self._load_result(done.token, job, done.results, done.seconds, nbytes))
            else:
                finished.append(self._store_result(done.token, job, done.results, done.reasons, done.seconds,
                                                   nbytes))
        self._note_evictions()
        return finished

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return []
        self._note_evictions()
        events, self._events = self._events, []
        return events

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._remote_lookups is not None:
            self._remote_lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._remote_lookups is not None:
            self._remote_lookups.flush()

    def drain_jobs(self) -> None:
        self._worker.wait_idle()

    def shutdown(self) -> None:
        if self._remote_lookups is not None:
            self._remote_lookups.shutdown()
        self._worker.close()
        self.chunks.close()
        # the last tensor over the primary tier's bytes: vLLM releases its memoryview once no export is left
        self._rows = self._rows.new_empty(0)

    # ---- results

    def _load_result(self, job_id: int, job: _Job, results: list[bool], seconds: float, nbytes: int) -> JobResult:
        if all(results):
            for k, key in zip(job.store_keys, job.keys):
                self._names[k] = key
            return JobResult(job_id=job_id, success=True, transfer_time=seconds, transfer_bytes=nbytes)
        loaded = tuple(key for key, ok in zip(job.keys, results) if ok)
        if self._remote_lookups is not None:
            self._remote_lookups.mark_miss([key for key, ok in zip(job.keys, results) if not ok])
        # counted (hicache:l3_checksum_failures) and logged by the store at most every few seconds: not here, per job
        logger.debug("hicache tier: %d of %d chunks of load job %d were missing or failed their checksum; "
                     "vLLM recomputes them", len(job.keys) - len(loaded), len(job.keys), job_id)
        return JobResult(job_id=job_id, success=False, successful_keys=loaded or None, transfer_time=seconds,
                         transfer_bytes=len(loaded) * self.block_size_bytes)

    def _store_result(self, job_id: int, job: _Job, results: list[bool], reasons: tuple[str | None, ...],
                      seconds: float, nbytes: int) -> JobResult:
        for k in job.store_keys:
            left = self._writing[k] - 1
            if left:
                self._writing[k] = left
            else:
                del self._writing[k]
        stored = [key for key, ok in zip(job.keys, results) if ok]
        for k, ok, key in zip(job.store_keys, results, job.keys):
            if ok:
                self._names[k] = key
        if self._events is not None and stored:
            self._events.append(self._event(stored, removed=False))
        success = all(handled(results, reasons))
        return JobResult(job_id=job_id, success=success, transfer_time=seconds, transfer_bytes=nbytes)

    def _note_evictions(self) -> None:
        evicted = self.chunks.store.take_evicted()
        if not evicted:
            return
        names = [self._names.pop(k) for k in evicted if k in self._names]
        if self._events is not None and names:
            self._events.append(self._event(names, removed=True))

    def _event(self, keys: list[OffloadKey], removed: bool) -> OffloadingEvent:
        return OffloadingEvent(keys=keys, medium=self.medium, removed=removed, locality=self.locality,
                               ownership=self.tier_type)

    # ---- metrics

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        metrics: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=(TIER_LABEL,))
            for name, (_, doc) in {**STORE_COUNTERS, **REMOTE_COUNTERS}.items()
        }
        metrics[QUEUE_REFUSED] = OffloadingCounterMetadata(
            documentation="Store jobs refused at once because hicache's write queue was full.",
            labelnames=(TIER_LABEL,))
        metrics[USED_CHUNKS] = OffloadingGaugeMetadata(documentation="Chunks held by hicache's L3 store.",
                                                       labelnames=(TIER_LABEL,))
        return metrics

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        label = (self.tier_type,)
        store = self.chunks.store.stats()
        sources = [(STORE_COUNTERS, store if self.chunks.local is not None else {})]
        if self.chunks.remote is not None:
            sources.append((REMOTE_COUNTERS, store["remote"]))
        for table, counters in sources:
            for name, (counter, _) in table.items():
                value = int(counters.get(counter, 0))
                delta = value - self._counters_seen.get(name, 0)
                self._counters_seen[name] = value
                if delta:
                    stats.increase_counter(name, delta, label)
        if self._refused:
            stats.increase_counter(QUEUE_REFUSED, self._refused, label)
            self._refused = 0
        stats.set_gauge(USED_CHUNKS, float(store.get("pages", 0)), label)
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("hicache_path", "hicache_size_gib", "hicache_io_backend", "hicache_remote")

    def config_info(self) -> ConfigInfoMapping:
        d = self.options.describe()
        return {"hicache_path": str(d["path"]), "hicache_size_gib": float(d["size_gib"]),
                "hicache_io_backend": self.chunks.store.io_backend, "hicache_remote": str(d.get("remote", ""))}


def vllm_identity(spec: OffloadingSpec) -> dict[str, Any]:
    """What changes the bytes of a vLLM primary-tier chunk: the model, the KV dtype, the hashing and chunking, the
    KV groups and layout, and the parallel layout whose workers' pages a chunk holds side by side."""
    config = spec.config
    p = config.parallel
    return {
        "engine": "vllm",
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "kv_groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "kv_cache_layout": config.kv_cache_layout,
        "canonical_layout": config.canonical_layout,
        "replicated_layout": config.replicated_layout,
        "parallel": [p.tp_size, p.pp_size, p.pcp_size, p.dcp_size],
        "rank": p.rank,
    }


def vllm_store_part(parallel: Any) -> str | None:
    """The store directory of one data-parallel replica (each has its own scheduler and primary tier, and a store
    has one writer); None without data parallelism."""
    if parallel.data_parallel_size > 1:
        return f"dp{parallel.data_parallel_size}-replica{parallel.data_parallel_index}"
    return None
