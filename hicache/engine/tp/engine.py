"""The tensor-parallel engine: rank 0 of `model.tp_size` ranks, which decides every step for all of them.

`build_tp_engine(cfg)` checks that the model splits over the ranks, starts the followers (hicache.engine.tp.group),
loads rank 0's shard, checks that every rank's tiers have the same capacities in pages, calibrates on all ranks at
once, and builds the cache with the lockstep proxies in place of its copier and L3 (hicache.engine.tp.ports).
`TPEngine` is the engine with each forward run as a plan exchange (hicache.engine.tp.lockstep): the scheduler, the
tree and the controller decide on rank 0 alone, and the followers make the same byte moves and run the same
forward. A lost rank raises RankLost out of `step`, which ends the engine thread (and the server) with that error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hicache.cache import TORCH_DTYPES, RankTiers, build_cache
from hicache.config import Config, ConfigError, SchedulerConfig
from hicache.engine.assembly import (
    attention_probe_sizes,
    calibrate_attention,
    calibrate_prefill,
    choose_kernels,
    engine_namespace,
    kv_layout,
    scratch_prefill,
    warm_up_prefix_kernel,
)
from hicache.engine.engine import Engine, EngineHalted, ForwardInputs
from hicache.engine.tp.follower import rank_device, rank_summary
from hicache.engine.tp.group import EXIT_GRACE_S, RankGroup
from hicache.engine.tp.lockstep import Collectives, Lockstep, RankLost
from hicache.engine.tp.ports import LockstepCopier, LockstepL3, LockstepWorker
from hicache.engine.tp.shard import TPShard, check_divisible
from hicache.engine.weights import DEFAULT_MODEL, load_model, smollm2_dir
from hicache.modelinfo import RANDOM_PRESETS, LlamaConfig, resolve_dtype

logger = logging.getLogger(__name__)


class TPEngine(Engine):
    """An Engine whose forwards run on every rank of a tensor-parallel group at once (see the module doc)."""

    def __init__(self, model: Any, tokenizer: Any, cache: Any, config: SchedulerConfig, lockstep: Lockstep,
                 group: RankGroup, timeout_s: float) -> None:
        # decode CUDA graphs would capture the collectives of one rank's forward; the ranks run eagerly instead
        super().__init__(model, tokenizer, cache, config, cuda_graph_max_batch=0)
        self.lockstep = lockstep
        self.group = group
        self.timeout_s = timeout_s
        self._exchanged = False

    def _run_forward(self, inputs: ForwardInputs, waits: Sequence[Any] = ()) -> torch.Tensor:
        self._exchanged = True
        return self.lockstep.exchange(inputs, lambda: Engine._run_forward(self, inputs, waits))

    def step(self) -> list:
        """One engine step; a step without a forward still exchanges a plan when ops or I/O reports wait, or when
        the heartbeat is due (followers must not sit in a collective as long as its timeout)."""
        self._exchanged = False
        outputs = super().step()
        if not self._exchanged and self.lockstep.due():
            self.lockstep.exchange()
        return outputs

    def stats(self) -> dict[str, Any]:
        """Engine.stats, with the plans sent to the ranks and the byte moves they carried among the counters."""
        s = super().stats()
        s["engine"].update(tp_size=self.group.size, tp_plans=self.lockstep.exchanges, tp_ops=self.lockstep.ops_sent)
        return s

    def close(self) -> None:
        """Abort what is left, wait for every rank's loads and writes, close the cache, stop the followers."""
        try:
            if self.lockstep.broken is None:
                self._drain()
        except EngineHalted:
            logger.error("closing with the tensor-parallel group lost: in-flight L3 I/O counts as failed")
        try:
            super().close()  # the L3 proxy exchanges plans until every rank's writes are done (or the group is lost)
        finally:
            intact = self.lockstep.broken is None
            self.lockstep.stop()
            self.group.close(grace_s=EXIT_GRACE_S if intact else 0.0)  # a broken group's followers: killed now

    def _drain(self) -> None:
        """Release the tickets of loads given up at shutdown once every rank has finished them."""
        for request_id in list(self.requests):
            self.abort(request_id)
        sched = self.scheduler
        sched.ctrl.launch_loads()
        deadline = time.monotonic() + self.timeout_s
        while sched.draining:
            if time.monotonic() > deadline:
                raise self.lockstep.halt(f"the ranks' page loads did not finish within {self.timeout_s:g} s of "
                                         "shutdown")
            self.lockstep.exchange()
            sched.ctrl.poll()
            sched.settle()
            if sched.draining:
                time.sleep(0.001)


def split_config(name: str) -> LlamaConfig | None:
    """The shapes of model `name` before loading it, to check that it splits (None: known only once loaded)."""
    if name.startswith("random:"):
        preset = RANDOM_PRESETS.get(name.removeprefix("random:"))
        return None if preset is None else dataclasses.replace(preset, name=name)
    path = smollm2_dir() if name == DEFAULT_MODEL else Path(name).expanduser()  # converts the GGUF once, here
    config = path / "config.json"
    if not config.is_file():
        return None
    return LlamaConfig.from_hf_config(json.loads(config.read_text()), name=name)


def check_summaries(summaries: Sequence[dict]) -> None:
    """Every rank's tiers must have rank 0's capacities in pages and page size, or page ids differ between them."""
    for rank, summary in enumerate(summaries[1:], start=1):
        if summary != summaries[0]:
            diff = {k: (summaries[0][k], summary.get(k)) for k in summaries[0] if summary.get(k) != summaries[0][k]}
            raise RankLost(f"tensor-parallel rank {rank}'s tiers differ from rank 0's (rank 0, rank {rank}): {diff}")


def build_tp_engine(cfg: Config, calibrate: bool = True, follower_command: Sequence[str] | None = None) -> TPEngine:
    """Start a tensor-parallel group of `cfg.model.tp_size` ranks and build its leader's engine (module doc).
    `follower_command`: see RankGroup.start."""
    size = cfg.model.tp_size
    config = split_config(cfg.model.name)
    if config is not None:
        try:
            check_divisible(config, size)
        except ValueError as e:
            raise ConfigError(f"model.tp_size: {e}") from None
    device = rank_device(cfg, 0)
    if device.type == "cuda":
        if torch.cuda.device_count() < size:
            raise ConfigError(f"model.tp_size {size} needs {size} GPUs, one a rank; {torch.cuda.device_count()} "
                              "are visible")
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // size))  # the ranks share the CPU's cores
    dtype_name = resolve_dtype(cfg.model.dtype, cfg.model.device)
    dtype = TORCH_DTYPES[dtype_name]
    if cfg.cache.l3.path is not None:  # the ranks' store directories go in it: made once, before they start
        from tiers.l3.lockfile import prepare_directory

        prepare_directory(os.path.abspath(cfg.cache.l3.path), read_only=False)
    group = RankGroup.start(cfg, follower_command)
    try:
        return _build_leader(cfg, group, device, dtype_name, dtype, calibrate)
    except BaseException:
        group.close(grace_s=0.0)
        raise


def _build_leader(cfg: Config, group: RankGroup, device: torch.device, dtype_name: str, dtype: torch.dtype,
                  calibrate: bool) -> TPEngine:
    size, ps = cfg.model.tp_size, cfg.cache.page_size
    model, tokenizer = load_model(cfg.model.name, dtype, device, shard=TPShard(0, size))
    layout = kv_layout(cfg, model, dtype)
    namespace = engine_namespace(cfg, model, dtype_name, layout)
    choose_kernels(cfg, model)
    check_summaries([rank_summary(cfg, layout), *group.wait_ready(cfg.model.tp_start_timeout_s)])
    group.join(device, cfg.model.tp_timeout_s)
    collectives = Collectives(0, size, device)
    lockstep = Lockstep(collectives, group, cfg.model.tp_timeout_s)

    def wrap_ports(tiers: RankTiers) -> tuple[Any, Any, Any]:
        """The controller's copier, L3 and worker: proxies over rank 0's own that record every byte move."""
        copier = LockstepCopier(tiers.copier, lockstep.record) if tiers.copier is not None else None
        l3 = LockstepL3(tiers.l3, lockstep.record) if tiers.l3 is not None else None
        worker = None
        if tiers.worker is not None:
            worker = LockstepWorker(tiers.worker, tiers.host, range(1, size), lockstep.record, lockstep.exchange,
                                    lambda: lockstep.broken is not None, cfg.model.tp_timeout_s)
            lockstep.reports_to(worker.receive, worker.awaiting)
        return copier, l3, worker

    speed = pair = None
    lp = cfg.cache.load_policy
    calibrating = lp.prefill_tokens_per_s is None and lp.mode == "auto" and calibrate
    if calibrating:
        speed = _lockstep_calibration(cfg, model, lockstep, ps)
    if device.type == "cuda" and model.uses_prefill_kernel(ps):
        seconds = lockstep.exchange(forward=lambda: warm_up_prefix_kernel(model, ps), scratch=("warm_up_prefix",))
        logger.info("prefix attention kernel warmed up on every rank in %.2f s", seconds)
    if calibrating and lp.attention_ns_per_pair is None:  # after the warm-up: the probe runs the prefix kernel
        pair = _lockstep_attention(model, lockstep, ps, speed)
    cache = build_cache(cfg, layout, dtype_name, device, namespace, prefill_tokens_per_s=speed,
                        attention_seconds_per_pair=pair, wrap_ports=wrap_ports)
    if device.type == "cuda" and cfg.model.cuda_graph_max_batch:
        logger.info("decode CUDA graphs off: under tensor parallelism every rank runs its forward eagerly")
    logger.info("tensor parallel: %d ranks, %d KV heads a rank; rank 0 plans every step", size,
                layout.num_kv_heads)
    return TPEngine(model, tokenizer, cache, cfg.scheduler, lockstep, group, cfg.model.tp_timeout_s)


def _lockstep_calibration(cfg: Config, model: Any, lockstep: Lockstep, page_size: int) -> float:
    """The prefill speed of the whole group: each timed prefill runs on every rank at once (a scratch plan)."""

    def run(n: int) -> float:
        return lockstep.exchange(forward=lambda: scratch_prefill(model, page_size, n), scratch=("prefill", n))

    speed = calibrate_prefill(model, page_size, run=run)
    logger.info("calibrated prefill speed over %d ranks: %.0f tokens/s", cfg.model.tp_size, speed)
    return speed


def _lockstep_attention(model: Any, lockstep: Lockstep, page_size: int, speed: float) -> float:
    """The attention cost per token pair of the whole group (calibrate_attention, each chunk on every rank)."""

    def run(n: int, context: int) -> float:
        return lockstep.exchange(forward=lambda: scratch_prefill(model, page_size, n, context),
                                 scratch=("prefill", n, context))

    chunk, context = attention_probe_sizes(model, page_size, speed)
    pair = calibrate_attention(model, page_size, chunk, context, run=run)
    logger.info("calibrated attention cost over the ranks: %.3f ns per token pair", pair * 1e9)
    return pair
