"""vLLM's own offloading stack on a CPU, with `HicacheTier` as its secondary tier: a real `TieringOffloadingSpec`
builds the CPU primary tier (a shared-memory region) and loads the tier by module path, as a vLLM server does; the
GPU side is played by writing and reading the primary tier's chunks directly."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

BLOCK_BYTES = 64 << 10
_engines = iter(range(1 << 30))


def offloading_config(tier: dict[str, Any], primary_chunks: int = 16, model: str = "org/model",
                      dtype: str = "bfloat16", events: bool = True, dp: tuple[int, int] = (0, 1)) -> OffloadingConfig:
    """A one-group, one-worker offloading config with `primary_chunks` CPU chunks of BLOCK_BYTES and `tier` as its
    one secondary tier."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0", "layers.1"), group_id=0),),
        worker_kv_bytes_per_block=BLOCK_BYTES, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": primary_chunks * BLOCK_BYTES, "block_size": 16,
                      "secondary_tiers": [{"type": "HicacheTier", "module_path": "hicache.integrations.vllm",
                                           **tier}]},
        engine_id=f"hicache-test-{next(_engines)}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=dp[0], data_parallel_size=dp[1],
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def keys(ids: Sequence[int], prefix: bytes = b"block") -> list[OffloadKey]:
    """vLLM offload keys: a 32-byte block hash per id, KV group 0."""
    return [make_offload_key(prefix + i.to_bytes(32 - len(prefix), "big"), 0) for i in ids]


def chunk_bytes(key: OffloadKey) -> np.ndarray:
    """The bytes a chunk of `key` holds in these tests: a pattern seeded by the key, so that every chunk differs."""
    seed = int.from_bytes(key[-12:], "big") % (1 << 32)
    return np.random.default_rng(seed).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


class Engine:
    """vLLM's TieringOffloadingManager over a CPU primary tier, driven as the offloading connector's scheduler
    drives it: a request per call, stores completed at once (the GPU -> CPU copy is a numpy write), steps ended
    with on_schedule_end."""

    def __init__(self, tier: dict[str, Any], primary_chunks: int = 16, **config: Any) -> None:
        self.spec = TieringOffloadingSpec(offloading_config(tier, primary_chunks, **config))
        self.manager = self.spec.get_manager()
        self.primary = self.manager.primary_tier
        self.tier = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.primary.get_kv_memoryview()).view(np.uint8)
        self._requests = iter(range(1 << 30))

    def request(self) -> ReqContext:
        ctx = ReqContext(req_id=f"req-{next(self._requests)}")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
            self.end_step()

    def end_step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def store(self, ks: Sequence[OffloadKey]) -> None:
        """Offload chunks to the primary tier (which cascades them to the secondary tier), one request."""
        ctx = self.request()
        with self.manager.lock:
            out = self.manager.prepare_store(ks, ctx)
            assert out is not None, "the primary tier refused the store"
            ids = out.store_spec.chunk_ids
            for key, cid in zip(out.keys_to_store, ids):
                self.rows[int(cid), :BLOCK_BYTES] = chunk_bytes(key)
            self.manager.complete_store(out.keys_to_store, ctx, success=True)
        self.finish(ctx)

    def settle(self, timeout: float = 30.0) -> None:
        """Step until the secondary tier has reported every job."""
        deadline = time.monotonic() + timeout
        while True:
            with self.manager.lock:
                self.tier.drain_jobs()
                self.manager._process_finished_jobs()
                self.end_step()
                if not self.tier.has_pending_work():
                    return
            assert time.monotonic() < deadline, "the tier's jobs did not finish"

    def lookup_all(self, ks: Sequence[OffloadKey], timeout: float = 30.0) -> list[LookupResult]:
        """Look every key up as a request does, stepping while a promotion from the secondary tier is pending, until
        each is a HIT or a MISS."""
        ctx = self.request()
        deadline = time.monotonic() + timeout
        results: list[LookupResult] = []
        while True:
            with self.manager.lock:
                results = [self.manager.lookup(k, ctx) for k in ks]
                self.end_step()
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                break
            self.settle(timeout)
            assert time.monotonic() < deadline, f"lookups still pending: {results}"
        self.finish(ctx)
        return results

    def read(self, ks: Sequence[OffloadKey]) -> list[np.ndarray]:
        """The bytes the primary tier holds for keys it has (as the GPU load would read them)."""
        ctx = self.request()
        with self.manager.lock:
            spec = self.manager.prepare_load(ks, ctx)
            out = [self.rows[int(cid), :BLOCK_BYTES].copy() for cid in spec.chunk_ids]
            self.manager.complete_load(ks, ctx)
        self.finish(ctx)
        return out

    def evict_primary(self, filler: int = 1 << 20) -> None:
        """Push every chunk out of the primary tier by storing as many other chunks."""
        ks = keys(range(filler, filler + self.primary._num_chunks), prefix=b"filler")
        for i in range(0, len(ks), 4):
            self.store(ks[i:i + 4])
            self.settle()

    def close(self) -> None:
        del self.rows  # vLLM releases the primary tier's memory only once nothing holds a view of it
        self.manager.shutdown()
