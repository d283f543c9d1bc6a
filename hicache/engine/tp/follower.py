"""A tensor-parallel follower: rank K > 0 of `hicache serve --tp N`, started by the leader (hicache.engine.tp.group).

It holds its shard of the model and its own GPU pool, host pool, copier and L3 store (same capacities in pages as
the leader's; its own namespace and L3 directory), and no scheduler, tree or controller: each exchange it applies
the leader's plan (hicache.engine.tp.lockstep) to its tiers, runs the plan's forward, and reports the L3 I/O it
finished. It exits when the leader sends the stop plan (0, after finishing its L3 writes) or when a collective
fails (1: the leader is gone).

    python -m hicache.engine.tp.follower --rank K --size N --store-port PORT < config.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hicache.cache import TORCH_DTYPES, RankTiers, build_tiers
from hicache.config import Config, from_dict
from hicache.engine.assembly import choose_kernels, engine_namespace, kv_layout, scratch_prefill, warm_up_prefix_kernel
from hicache.engine.engine import unpack_inputs
from hicache.engine.host_io import HostStaging
from hicache.engine.tp.group import READY_KEY
from hicache.engine.tp.lockstep import STOP, Collectives, Plan, Report
from hicache.engine.tp.shard import TPShard
from hicache.engine.weights import load_model
from hicache.modelinfo import resolve_device, resolve_dtype
from hicache.sizes import resolve_sizes
from tiers.layered_copy import layer_waits

logger = logging.getLogger(__name__)

# forwards outside serving that every rank runs at once (Plan.scratch), by name: (model, page size, *args)
SCRATCH_FORWARDS: dict[str, Callable[..., Any]] = {
    "prefill": scratch_prefill,
    "warm_up_prefix": warm_up_prefix_kernel,
}


def rank_summary(cfg: Config, layout: Any) -> dict[str, Any]:
    """What must agree on every rank for page ids to mean the same: the tiers' capacities in pages and the page's
    size (each follower's goes with its ready key; the leader checks them before the process group forms)."""
    s = resolve_sizes(cfg, layout.bytes_per_token)
    return {"device_pages": s.device_pages, "host_pages": s.host_pages, "disk_pages": s.disk_pages,
            "remote_pages": s.remote_pages, "page_bytes": layout.page_bytes, "num_kv_heads": layout.num_kv_heads}


class PlanOps:
    """Applies a plan's ops to this rank's tiers (the op forms are listed in hicache.engine.tp.ports)."""

    def __init__(self, tiers: RankTiers) -> None:
        self.tiers = tiers
        self._copies: list[Any] = []  # this plan's backups, waited for before its forward
        self.loads: list[Any] = []  # this plan's loads: its forward waits for them layer by layer (`settle_loads`)
        self._fills: dict[int, Any] = {}  # host page -> this plan's GPU -> host copy filling it
        self._refused: list[tuple[int, list[bool]]] = []  # writes this rank could not queue: failed at once

    def apply(self, ops: Sequence[tuple]) -> None:
        for op in ops:
            getattr(self, f"_{op[0]}")(*op[1:])
        for handle in self._copies:  # the plan's forward may overwrite GPU pages the leader freed behind them
            handle.wait()
        self._copies.clear()
        self._fills.clear()

    def settle_loads(self) -> None:
        """Wait for this plan's loads (after its forward is queued, which waited for them on the GPU): the leader
        reuses their host pages once its own copies have landed, so no copy of this rank outlives its plan."""
        for handle in self.loads:
            handle.wait()
        self.loads.clear()

    def finished(self) -> list[tuple[int, list[bool]]]:
        """(op id, per-page results) of the reads and writes finished since the last call."""
        done, self._refused = self._refused, []
        worker = self.tiers.worker
        if worker is not None:
            done += [(c.token, list(c.results)) for c in worker.completions()]
        return done

    def _to_host(self, device_pages: list[int], host_pages: list[int]) -> None:
        handle = self.tiers.copier.to_host(device_pages, host_pages)
        self._copies.append(handle)
        self._fills.update(dict.fromkeys(host_pages, handle))

    def _to_device(self, host_pages: list[int], device_pages: list[int]) -> None:
        self.loads.append(self.tiers.copier.to_device(host_pages, device_pages))

    def _views(self, host_pages: list[int]) -> list[Any]:
        return [self.tiers.host.page_view(p) for p in host_pages]

    def _read(self, op: int, keys: list[bytes], host_pages: list[int]) -> None:
        self.tiers.worker.submit_read(op, keys, self._views(host_pages))

    def _write(self, op: int, keys: list[bytes], host_pages: list[int], staged: bool) -> None:
        fills = {id(h): h for p in host_pages if (h := self._fills.get(p)) is not None}
        pages = self._views(host_pages)
        if staged:  # the leader copied these pages for the write before freeing them: so does this rank, now
            for handle in fills.values():
                handle.wait()
            fills = {}
            pages = self.tiers.worker.stage(pages)
            if pages is None:
                self._refused.append((op, [False] * len(keys)))
                return
        waits = list(fills.values())
        before = (lambda: [h.wait() for h in waits]) if waits else None
        if not self.tiers.worker.submit_write(op, keys, pages, before):
            self._refused.append((op, [False] * len(keys)))

    def _delete(self, keys: list[bytes]) -> None:
        self.tiers.l3.delete(keys, wait=False)

    def _note_hit(self, keys: list[bytes]) -> None:
        self.tiers.l3.note_hit(keys)


def follow(collectives: Collectives, model: Any, tiers: RankTiers, page_size: int) -> None:
    """Follow the leader's plans until its stop plan (see the module doc)."""
    ops = PlanOps(tiers)
    device = tiers.device.device
    staging = HostStaging(device) if device.type == "cuda" else None
    upload = staging.upload if staging is not None else None
    kv = tiers.device.kv
    while True:
        plan: Plan = collectives.broadcast_plan(None)
        error = None
        try:
            ops.apply(plan.ops)
        except Exception as e:  # noqa: BLE001 - reported: the leader halts the group, this rank exits
            logger.exception("rank %d could not apply plan %d", collectives.rank, plan.seq)
            error = repr(e)
        if plan.kind == STOP:
            return
        if plan.scratch is not None:
            name, *args = plan.scratch
            SCRATCH_FORWARDS[name](model, page_size, *args)
        if plan.inputs is not None:  # each layer waits for this rank's loads of it (tiers/layered_copy.py)
            model(unpack_inputs(plan.inputs, device, upload), kv, page_size, before_layer=layer_waits(ops.loads))
        ops.settle_loads()
        collectives.gather_reports(Report(collectives.rank, ops.finished(), error))
        if error is not None:
            raise RuntimeError(f"rank {collectives.rank} stopped following: {error}")


def rank_device(cfg: Config, rank: int) -> torch.device:
    """Rank K's device: cuda:K, or the CPU."""
    device = resolve_device(cfg.model.device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def serve_rank(cfg: Config, rank: int, store_port: int) -> None:
    """Load this rank's shard and build its tiers, say so in the leader's store (with what the leader checks),
    join the process group, follow the plans, close."""
    size = cfg.model.tp_size
    device = rank_device(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False,
                          timeout=datetime.timedelta(seconds=cfg.model.tp_start_timeout_s))
    dtype_name = resolve_dtype(cfg.model.dtype, cfg.model.device)
    dtype = TORCH_DTYPES[dtype_name]
    model, _ = load_model(cfg.model.name, dtype, device, shard=TPShard(rank, size))
    layout = kv_layout(cfg, model, dtype)
    choose_kernels(cfg, model)
    tiers = build_tiers(cfg, layout, dtype_name, device, engine_namespace(cfg, model, dtype_name, layout))
    try:
        store.set(READY_KEY.format(rank=rank), json.dumps(rank_summary(cfg, layout)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=cfg.model.tp_timeout_s))
        follow(Collectives(rank, size, device), model, tiers, cfg.cache.page_size)
    finally:
        tiers.close()  # finishes queued L3 writes
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one follower rank of a tensor-parallel hicache server")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s rank {args.rank} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the leader stops us
    cfg = from_dict(json.loads(sys.stdin.read()), "the leader's config")
    if cfg.model.tp_size != args.size or not 0 < args.rank < args.size:
        raise SystemExit(f"rank {args.rank} of {args.size} does not fit model.tp_size {cfg.model.tp_size}")
    try:
        serve_rank(cfg, args.rank, args.store_port)
    except Exception as e:  # noqa: BLE001 - the leader is gone or the plan could not be followed: say why, exit 1
        logger.error("rank %d stops: %s", args.rank, e)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: gloo's threads of a broken group abort it
    return 0


if __name__ == "__main__":
    sys.exit(main())
