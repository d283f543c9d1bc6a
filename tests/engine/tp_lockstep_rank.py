"""The ranks of a tensor-parallel engine for tests/engine/test_tp_serve.py, each logging its collectives.

    python tp_lockstep_rank.py leader CONFIG.json OUT.json [greedy]  # rank 0: runs the scenario
    python tp_lockstep_rank.py follower LOG_DIR --rank K ...  # a follower (RankGroup.start adds the arguments)

Every rank records the collectives it enters (broadcast_object_list, all_gather_object, all_reduce, all_gather,
with tensor shapes), so that the test can check that all ranks made the same ones in the same order. The
leader's scenario drives the early exits and the tiers: a batch larger than max_running_requests (requests wait
in the queue), an idle engine (heartbeat plans only), a prefix served from host memory, one served from L3, one
whose L3 read fails on rank 1 only (its slab file is overwritten) and is recomputed, and one read into host memory
while its request waits in the queue (a prefetch). "greedy": two requests in a batch and the miss only, for a
config without host and L3 tiers. Outputs, cache counters and the leader's log of collectives go to OUT.json;
each follower writes its log to LOG_DIR/rank-K.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

COLLECTIVES = ("broadcast_object_list", "all_gather_object", "all_reduce", "all_gather")


def record_collectives() -> list[str]:
    """Wrap torch.distributed's collectives (as the engine calls them, through the module) to log each call."""
    log: list[str] = []
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            first = args[0] if args else None
            shape = tuple(first.shape) if hasattr(first, "shape") else ()
            if _name == "all_gather":  # a list of output tensors, then the input
                shape = tuple(args[1].shape)
            log.append(f"{_name}{list(shape)}" if shape else _name)
            return _real(*args, **kwargs)

        setattr(dist, name, wrapper)
    return log


def follower(log_dir: str, argv: list[str]) -> int:
    log = record_collectives()
    from hicache.engine.tp import follower as tp_follower

    rank = int(argv[argv.index("--rank") + 1])
    code = tp_follower.main(argv)
    with open(os.path.join(log_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(log, f)
    return code


PROMPT_BATCH = [[(7 * i + 13 * j) % 500 + 3 for j in range(18 + 3 * i)] for i in range(4)]
SHARED = [(11 * j + 5) % 500 + 3 for j in range(40)]  # the prefix the tiers serve: 10 pages of 4 tokens
FILLERS = [[(17 * i + 29 * j) % 500 + 3 for j in range(44)] for i in range(1, 10)]  # 11 pages each


def generate(engine, prompts: list[list[int]], max_tokens: int | list[int]) -> list[dict]:
    """Run prompts together to completion (greedy; max_tokens for all, or each its own); each output's tokens and
    cached tokens per tier."""
    from hicache.engine.params import SamplingParams

    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt, limit in zip(ids, prompts, limits):
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True))
    tokens = {i: [] for i in ids}
    cached: dict[str, dict] = {}
    errors: dict[str, str | None] = {}
    while len(cached) < len(ids):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                cached[out.request_id] = dict(out.usage.cached_tokens)
                errors[out.request_id] = out.error
        engine.cache.controller.check_integrity()
    return [{"tokens": tokens[i], "cached": cached[i], "error": errors[i]} for i in ids]


def settle_io(engine) -> None:
    """Every rank's queued L3 writes done and applied (the proxy exchanges plans until they are)."""
    assert engine.cache.controller.worker.wait_idle(60.0)
    engine.step()


def idle(engine, seconds: float) -> int:
    """Step an engine with nothing to do, as the engine thread does; returns the plans exchanged meanwhile."""
    before = engine.lockstep.exchanges if hasattr(engine, "lockstep") else 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        engine.step()
        time.sleep(0.05)
    return (engine.lockstep.exchanges if hasattr(engine, "lockstep") else 0) - before


def corrupt_rank_store(l3_dir: str) -> int:
    """Overwrite every page slot of a store's slab (its header kept): each read of it then fails its checksum."""
    from tiers.l3.format import HEADER_BYTES
    from tiers.l3.slab import slab_path

    path = slab_path(l3_dir)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES)
        f.write(b"\xa5" * (size - HEADER_BYTES))
        f.flush()
        os.fsync(f.fileno())
    return size - HEADER_BYTES


def leader(config_path: str, out_path: str, scenario: str = "full") -> int:
    log = record_collectives()
    from hicache.config import from_dict
    from hicache.engine.builder import build_engine
    from hicache.engine.tp.engine import build_tp_engine

    with open(config_path) as f:
        cfg = from_dict(json.load(f), config_path)
    tp = cfg.model.tp_size
    if tp > 1:
        log_dir = os.path.dirname(os.path.abspath(out_path))
        command = [sys.executable, os.path.abspath(__file__), "follower", log_dir]
        engine = build_tp_engine(cfg, calibrate=False, follower_command=command)
    else:
        engine = build_engine(cfg, calibrate=False)
    result: dict = {"tp": tp}
    try:
        if scenario == "greedy":  # two requests in one batch, then one alone
            result["batch"] = generate(engine, PROMPT_BATCH[:2], 4)
            result["miss"] = generate(engine, [SHARED], 8)[0]
            return 0
        result["batch"] = generate(engine, PROMPT_BATCH, 6)  # 4 requests, 2 run at a time: the rest wait
        result["idle_exchanges"] = idle(engine, 2.5)  # heartbeats only
        result["miss"] = generate(engine, [SHARED], 6)[0]
        # a filler takes the GPU pool: the shared prefix stays in host memory
        result["fillers"] = generate(engine, FILLERS[:1], 2)
        result["host"] = generate(engine, [SHARED], 6)[0]
        # the hit queued L3 writes of the prefix and its continuation; while one is in flight its pages, and the
        # ancestors above them, stay in host memory, so where the fillers leave the prefix would depend on how
        # fast the disk is: every write lands first
        settle_io(engine)
        # two take the GPU and host pools: the shared prefix stays on disk
        result["fillers"] += generate(engine, FILLERS[1:3], 2)
        settle_io(engine)
        result["disk"] = generate(engine, [SHARED], 6)[0]
        settle_io(engine)
        result["fillers"] += generate(engine, FILLERS[3:5], 2)
        settle_io(engine)
        failures = engine.stats()["cache"]["load_failures"]
        if tp > 1:
            from hicache.cache import l3_directory

            result["corrupted_bytes"] = corrupt_rank_store(l3_directory(cfg, 1))
        result["failed_read"] = generate(engine, [SHARED], 6)[0]
        result["load_failures"] = engine.stats()["cache"]["load_failures"] - failures
        settle_io(engine)
        result["fillers"] += generate(engine, FILLERS[5:7], 2)
        settle_io(engine)
        prefetched = engine.stats()["cache"]["prefetched_pages"]
        # one filler runs at a time (the GPU pool holds one), so the shared prefix waits in the queue meanwhile
        # and its disk pages are read into host memory before it is admitted
        result["prefetched"] = generate(engine, [*FILLERS[7:9], SHARED], [2, 2, 6])[2]
        result["prefetched_pages"] = engine.stats()["cache"]["prefetched_pages"] - prefetched
        result["stats"] = engine.stats()["cache"]
        return 0
    finally:
        engine.close()
        result["collectives"] = log
        with open(out_path, "w") as f:
            json.dump(result, f, default=str)


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "follower":
        sys.exit(follower(rest[0], rest[1:]))
    sys.exit(leader(*rest))
