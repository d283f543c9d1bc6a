"""The processes of a tensor-parallel group, from the leader's side: start the followers, join the process group
with them, notice one that exits, and end them all.

The leader (rank 0, this process) hosts the group's TCP store on a port the kernel picks, starts ranks 1..N-1 as
`python -m hicache.engine.tp_follower` (the config on their stdin, this checkout's packages first on their path),
and joins the group: NCCL on CUDA (rank K on cuda:K), gloo on the CPU. Every collective has the config's timeout.
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

import torch
import torch.distributed as dist

from hicache.config import Config, to_dict
from hicache.engine.lockstep import RankLost

logger = logging.getLogger(__name__)

FOLLOWER_MODULE = "hicache.engine.tp_follower"
EXIT_GRACE_S = 30.0  # how long a follower may take to close its tiers after the stop plan before it is killed
LOSS_NOTICE_S = 2.0  # after a failed collective, how long to wait for the lost follower's exit to show


class RankGroup:
    """The follower processes and the default process group they share with this one (rank 0)."""

    def __init__(self, procs: list[subprocess.Popen], size: int) -> None:
        self.procs = procs  # rank k is procs[k - 1]
        self.size = size

    @classmethod
    def start(cls, cfg: Config, device: torch.device, follower_command: Sequence[str] | None = None) -> RankGroup:
        """Start ranks 1..N-1 and join the group with them (blocks until they have all joined, or the timeout).
        `follower_command`: the program of a follower, run with `--rank K --size N --store-port P` (default:
        this interpreter with `-m hicache.engine.tp_follower`)."""
        size = cfg.model.tp_size
        timeout = datetime.timedelta(seconds=cfg.model.tp_timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        command = list(follower_command or [sys.executable, "-m", FOLLOWER_MODULE])
        config = json.dumps(to_dict(cfg))
        root = str(Path(__file__).resolve().parents[2])  # this checkout's packages, not another installed copy
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *inherited])}
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        procs = []
        try:
            for rank in range(1, size):
                proc = subprocess.Popen([*command, "--rank", str(rank), "--size", str(size), "--store-port",
                                         str(store.port), "--log-level", str(level)], stdin=subprocess.PIPE, env=env)
                proc.stdin.write(config.encode())
                proc.stdin.close()
                procs.append(proc)
            group = cls(procs, size)
            logger.info("tensor parallel: started ranks 1..%d (pids %s); joining the group", size - 1,
                        ", ".join(str(p.pid) for p in procs))
            backend = "nccl" if device.type == "cuda" else "gloo"
            try:
                dist.init_process_group(backend, store=store, rank=0, world_size=size, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - a follower that never joined: name it
                raise RankLost(f"{group.describe_loss() or 'a tensor-parallel rank did not join'} "
                               f"(starting the group failed: {e})") from e
        except BaseException:
            for proc in procs:
                proc.kill()
                proc.wait()
            raise
        return group

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
                logger.error("tensor-parallel rank %d (pid %d) did not exit: killing it", rank, proc.pid)
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may fail to tear down; its peers are gone anyway
                logger.exception("leaving the process group failed")
