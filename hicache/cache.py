"""Assemble the cache stack (tree, pools, copier, L3 store, controller) from a Config."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from controller import CostModel, L3Worker, TierController, calibrate
from hicache.config import Config, ConfigError
from hicache.sizes import ResolvedSizes, resolve_sizes
from radix import RadixTree, namespace_fingerprint
from tiers import DevicePool, HostPool, KVLayout, make_copier

logger = logging.getLogger(__name__)

SYNC_BATCH_BYTES = 64 << 20  # default L3 write group: pages sharing one fdatasync and index commit
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CacheStack:
    """Everything the engine (or the replay tool) needs from the cache, and how it was sized."""

    controller: TierController
    sizes: ResolvedSizes
    layout: KVLayout
    namespace: bytes
    l3: Any | None
    kv: Any  # the GPU pool's KV tensor, which the model's forward reads and writes

    def close(self) -> None:
        self.controller.close()
        if self.l3 is not None:
            self.l3.close()


def namespace_fields(model_id: str, revision: str, dtype: str, layout: KVLayout, tp_rank: int,
                     tp_size: int = 1) -> dict:
    """Everything that changes the bytes of a page: the cache namespace. A tensor-parallel rank's pages hold its
    head shard, so rank and size are in it (the size only above 1: stores written without tensor parallelism keep
    their namespace, and a TP=2 rank 0 never reads them, nor they its pages)."""
    fields = {
        "model": model_id,
        "revision": revision,
        "dtype": dtype,
        "kv_layout": "page-first[layers][k|v][page_size][kv_heads][head_dim]",
        "page_size": layout.page_size,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "tp_rank": tp_rank,
    }
    if tp_size > 1:
        fields["tp_size"] = tp_size
    return fields


def cost_model(cfg: Config, layout: KVLayout, prefill_tokens_per_s: float | None = None,
               attention_seconds_per_pair: float | None = None) -> CostModel:
    """The load-or-recompute model: configured costs, else the calibrated ones given (attention: 0 if neither)."""
    lp = cfg.cache.load_policy
    gbps = lambda v: None if v is None else v * 1e9  # noqa: E731
    pair = lp.attention_ns_per_pair * 1e-9 if lp.attention_ns_per_pair is not None else attention_seconds_per_pair
    return CostModel(
        layout.page_size,
        layout.page_bytes,
        lp.mode,
        lp.prefill_tokens_per_s or prefill_tokens_per_s,
        gbps(lp.host_to_device_gbps),
        gbps(lp.disk_to_device_gbps),
        attention_seconds_per_pair=pair or 0.0,
        adaptive=lp.disk_to_device_gbps is None,
        overlap=lp.overlap,
    )


def calibrate_bandwidths(cost: CostModel, cfg: Config, device: DevicePool, host: HostPool | None, copier: Any,
                         l3: Any | None) -> CostModel:
    """The cost model with host->GPU and L3->GPU bandwidths measured where the config leaves them unset."""
    lp = cfg.cache.load_policy
    if lp.mode != "auto" or host is None:
        return cost
    if lp.host_to_device_gbps is None:
        cost = dataclasses.replace(cost, host_to_device_bytes_per_s=calibrate.host_to_device_bandwidth(
            copier, device, host))
    if lp.disk_to_device_gbps is None and l3 is not None:
        cost = dataclasses.replace(cost, disk_to_device_bytes_per_s=calibrate.disk_to_device_bandwidth(
            l3, copier, device, host))
    cap = cfg.cache.l3.read_limit_gbps * 1e9 if cfg.cache.l3.path else 0.0
    if cap and l3 is not None and cost.disk_to_device_bytes_per_s and cost.disk_to_device_bytes_per_s > cap:
        # a short probe fits the limiter's burst: reads under load run at the cap, and prefetch and the plan's
        # split are sized by this figure from the first request on (measured reads refine it, as anywhere)
        cost = dataclasses.replace(cost, disk_to_device_bytes_per_s=cap)
    logger.info("cost model: %s", cost.describe())
    return cost


REMOTE_PASSWORD_ENV = "HICACHE_REMOTE_PASSWORD"


def _remote_args(cfg: Config, namespace: bytes, page_bytes: int) -> dict:
    r = cfg.cache.remote
    return dict(url=r.url, namespace=namespace, page_bytes=page_bytes, username=r.username,
                password=r.password or os.environ.get(REMOTE_PASSWORD_ENV) or None, key_prefix=r.key_prefix,
                timeout_s=r.timeout_s, admission_hits=r.admission_hits)


def l3_in_process(cfg: Config, device: torch.device) -> bool:
    """Whether the L3 store runs in a process of its own (`cache.l3.worker`, tiers/l3/process.py)."""
    mode = cfg.cache.l3.worker
    if mode != "auto":
        return mode == "process"
    if device.type != "cuda" or cfg.cache.l3.io_backend == "kvikio":
        return False
    if cfg.cache.l3.io_backend == "auto":  # GPUDirect Storage active: the store's threads move no bytes themselves
        from tiers.l3.io import kvikio_compat_mode, kvikio_usable

        if kvikio_usable()[0] and not kvikio_compat_mode():
            return False
    return True


def l3_directory(cfg: Config, tp_rank: int) -> str | None:
    """Where a rank's L3 store lives: `cache.l3.path` itself, or under tensor parallelism a directory of its own
    in it (`tp<size>-rank<rank>`): a store holds one namespace, and each rank's holds its own head shard."""
    path, size = cfg.cache.l3.path, cfg.model.tp_size
    if path is None or size == 1:
        return path
    return os.path.join(path, f"tp{size}-rank{tp_rank}")


@dataclass
class RankTiers:
    """The byte stores of one model rank: its pools, the copier between them, and the L3 store with the worker
    that runs its I/O (absent tiers are None)."""

    sizes: ResolvedSizes
    namespace: bytes
    device: DevicePool
    host: HostPool | None
    copier: Any | None
    l3: Any | None
    worker: Any | None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.l3 is not None:
            self.l3.close()


def build_tiers(cfg: Config, layout: KVLayout, dtype: str, device: torch.device | str,
                namespace: dict | None = None) -> RankTiers:
    """Create one model rank's pools, copier and L3 store (when configured), sized by the config."""
    sizes = resolve_sizes(cfg, layout.bytes_per_token)
    fields = namespace or {}
    ns = namespace_fingerprint(fields)
    if (sizes.disk_pages or sizes.remote_pages) and not sizes.host_pages:
        tier = "cache.l3" if sizes.disk_pages else "cache.remote"
        raise ConfigError(f"{tier}: the disk tier needs a host tier (cache.host size > 0): "
                          "pages reach it through host memory")
    device_pool = DevicePool(layout, sizes.device_pages, TORCH_DTYPES[dtype], device)
    persistent = bool(sizes.disk_pages or sizes.remote_pages)
    in_process = persistent and l3_in_process(cfg, device_pool.device)
    host_pool = (HostPool(layout, sizes.host_pages, TORCH_DTYPES[dtype], shared=in_process)
                 if sizes.host_pages else None)
    copier = make_copier(device_pool, host_pool, cfg.cache.load_policy.layered) if host_pool is not None else None
    l3 = worker = None
    if persistent:
        c = cfg.cache.l3
        slot_bytes = -(-layout.page_bytes // 4096) * 4096  # slots are 4 KiB aligned
        # small pages need many per sync: one fdatasync + LMDB commit per 32 small pages ran far below raw
        sync_pages = c.sync_batch_pages or max(32, SYNC_BATCH_BYTES // layout.page_bytes)
        store_args = dict(path=l3_directory(cfg, int(fields.get("tp_rank", 0))),
                          capacity_bytes=sizes.disk_pages * slot_bytes, page_bytes=layout.page_bytes,
                          namespace=ns, namespace_fields=fields, io_backend=c.io_backend, io_threads=c.io_threads,
                          sync_batch_pages=sync_pages, admission_hits=c.admission_hits,
                          read_limit_bytes_per_s=c.read_limit_gbps * 1e9,
                          write_limit_bytes_per_s=c.write_limit_gbps * 1e9) if sizes.disk_pages else None
        remote_args = _remote_args(cfg, ns, layout.page_bytes) if sizes.remote_pages else None
        if in_process:
            from tiers.l3.process import L3Process

            proc = L3Process(host_pool, store_args, threads=c.io_threads, queue_pages=c.queue_pages,
                             batch_pages=sync_pages, remote_args=remote_args, remote_pages=sizes.remote_pages)
            l3, worker = proc.store, proc.worker
        else:
            from tiers.persistent import open_persistent

            l3 = open_persistent(store_args, remote_args, sizes.remote_pages)
            worker = L3Worker(l3, threads=c.io_threads, queue_pages=c.queue_pages, batch_pages=sync_pages)
    return RankTiers(sizes, ns, device_pool, host_pool, copier, l3, worker)


Ports = tuple[Any, Any, Any]  # (copier, L3 store, L3 worker), each None where the tier is absent


def build_cache(
    cfg: Config,
    layout: KVLayout,
    dtype: str,
    device: torch.device | str,
    namespace: dict | None = None,
    prefill_tokens_per_s: float | None = None,
    attention_seconds_per_pair: float | None = None,
    wrap_ports: Callable[[RankTiers], Ports] | None = None,
) -> CacheStack:
    """Create the pools, the L3 store (when configured) and the controller for one model rank. `wrap_ports`: the
    copier, L3 store and worker the controller is given, made from the rank's tiers (tensor parallelism: proxies
    that also send each byte move to the other ranks); by default the tiers' own."""
    tiers = build_tiers(cfg, layout, dtype, device, namespace)
    sizes, ns = tiers.sizes, tiers.namespace
    tree = RadixTree(cfg.cache.page_size, ns, cfg.cache.eviction_policy)
    device_pool, host_pool, l3 = tiers.device, tiers.host, tiers.l3
    cost = cost_model(cfg, layout, prefill_tokens_per_s, attention_seconds_per_pair)
    cost = calibrate_bandwidths(cost, cfg, device_pool, host_pool, tiers.copier, l3)
    if getattr(tiers.copier, "layers", None) is not None:  # loads stream in under the forward (CostModel)
        cost = dataclasses.replace(cost, host_streams=True)
        logger.info("host -> GPU loads go layer by layer under the forward (cache.load_policy.layered)")
    copier, ports_l3, worker = wrap_ports(tiers) if wrap_ports is not None else (tiers.copier, l3, tiers.worker)
    sched = cfg.scheduler
    controller = TierController(
        tree, device_pool, host_pool, ports_l3, copier, cfg.cache.write_policy, cost, worker,
        min(sizes.disk_pages + sizes.remote_pages, l3.capacity_pages) if l3 is not None else None,
        prefetch=cfg.cache.load_policy.prefetch,
        prefetch_host_share=cfg.cache.load_policy.prefetch_host_share,
        prefetch_queue_s=cfg.cache.load_policy.prefetch_queue_s,
        stage=cfg.cache.load_policy.stage,
        launch_later=sched.launch_loads_after_forward or sched.admit_during_forward,
    )
    if controller.launch_later:
        logger.info("page loads start once each step's forward is queued (scheduler.launch_loads_after_forward)")
    logger.info(
        "cache: page %d tokens x %d bytes; device %d pages, host %d pages, disk %d pages",
        layout.page_size, layout.page_bytes, sizes.device_pages, sizes.host_pages, sizes.disk_pages,
    )
    return CacheStack(controller, sizes, layout, ns, l3, device_pool.kv)
