"""The processes of a tensor-parallel group, from the leader's side: start the followers, wait until they are
ready, form the process group with them, notice one that exits, and end them all.

The leader (rank 0, this process) hosts the group's TCP store on a port the kernel picks and starts ranks 1..N-1
as `python -m hicache.engine.tp.follower` (the config on their stdin, this checkout's packages first on their
path). Each loads its shard and builds its tiers, which can take minutes for a large model, then sets its ready key
in the store with a summary of its tiers; the leader, loading its own shard meanwhile, waits for those keys while
watching the processes (`model.tp_start_timeout_s`), so a follower that fails to start is named at once. Only then
is the process group formed (NCCL on CUDA, rank K on cuda:K; gloo on the CPU), with `model.tp_timeout_s` on
every collective: no collective waits for a rank that is still loading.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hicache.config import Config, to_dict
from hicache.engine.tp.lockstep import RankLost

logger = logging.getLogger(__name__)

FOLLOWER_MODULE = "hicache.engine.tp.follower"
EXIT_GRACE_S = 30.0  # how long a follower may take to close its tiers after the stop plan before it is killed
LOSS_NOTICE_S = 1.0  # after a failed collective, how long to wait for the lost follower's exit to show


READY_KEY = "hicache/ready/{rank}"  # a follower's summary of its tiers, set in the store once it can follow
READY_POLL_S = 0.1


class RankGroup:
    """The follower processes, the TCP store this process hosts for them, and the default process group."""

    def __init__(self, procs: list[subprocess.Popen], size: int, store: Any) -> None:
        self.procs = procs  # rank k is procs[k - 1]
        self.size = size
        self.store = store

    @classmethod
    def start(cls, cfg: Config, follower_command: Sequence[str] | None = None) -> RankGroup:
        """Start ranks 1..N-1; they load their shards and build their tiers meanwhile (`wait_ready`, then
        `join`). `follower_command`: the program of a follower, run with `--rank K --size N --store-port P
        --log-level L` (default: this interpreter with `-m hicache.engine.tp.follower`)."""
        size = cfg.model.tp_size
        start = datetime.timedelta(seconds=cfg.model.tp_start_timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=start, wait_for_workers=False)
        command = list(follower_command or [sys.executable, "-m", FOLLOWER_MODULE])
        config = json.dumps(to_dict(cfg))
        root = str(Path(__file__).resolve().parents[2])  # this checkout's packages, not another installed copy
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *inherited])}
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        group = cls([], size, store)
        try:
            for rank in range(1, size):
                proc = subprocess.Popen([*command, "--rank", str(rank), "--size", str(size), "--store-port",
                                         str(store.port), "--log-level", str(level)], stdin=subprocess.PIPE, env=env)
                group.procs.append(proc)
                try:
                    proc.stdin.write(config.encode())
                    proc.stdin.close()
                except BrokenPipeError:  # it exited already: wait_ready names it
                    pass
        except BaseException:
            group.close(grace_s=0.0)
            raise
        logger.info("tensor parallel: started ranks 1..%d (pids %s)", size - 1,
                    ", ".join(str(p.pid) for p in group.procs))
        return group

    def wait_ready(self, timeout_s: float) -> list[dict]:
        """Wait until every follower has loaded its shard and built its tiers; their summaries, by rank from 1.
        Raises RankLost if one exits first, or if they are not all ready within timeout_s."""
        keys = [READY_KEY.format(rank=rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                waiting = [rank for rank, key in enumerate(keys, start=1) if not self.store.check([key])]
                raise RankLost(f"tensor-parallel ranks {waiting} were not ready within {timeout_s:.0f} s "
                               "(model.tp_start_timeout_s)")
            time.sleep(READY_POLL_S)
        return [json.loads(self.store.get(key)) for key in keys]

    def join(self, device: torch.device, timeout_s: float) -> None:
        """Form the process group with the ready followers (NCCL on CUDA, gloo on the CPU); every collective of
        it then ends with an error after timeout_s."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, store=self.store, rank=0, world_size=self.size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - a follower that never joined: name it
            raise RankLost(f"{self.describe_loss() or 'a tensor-parallel rank did not join'} "
                           f"(forming the process group failed: {e})") from e

    def check_alive(self) -> None:
        """Raise RankLost naming the first follower that has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RankLost(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def describe_loss(self) -> str | None:
        """Which follower has exited (waiting up to LOSS_NOTICE_S for one to), or None."""
        deadline = time.monotonic() + LOSS_NOTICE_S
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None:
                    return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self, grace_s: float = EXIT_GRACE_S) -> None:
        """Wait up to grace_s for the followers to exit (after the stop plan; 0: kill them now), kill the rest,
        and leave the process group."""
        deadline = time.monotonic() + grace_s
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if grace_s:
                    logger.error("tensor-parallel rank %d (pid %d) did not exit: killing it", rank, proc.pid)
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may fail to tear down; its peers are gone anyway
                logger.exception("leaving the process group failed")
