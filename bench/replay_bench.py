"""Replay throughput (blocks/s) on one CPU core: the sample Mooncake trace through the real controller.

    .venv/bin/python bench/replay_bench.py [--trace FILE] [--repeat 3] [--cpu 0]

Each case replays the whole trace with fresh tiers (sizes in 512-token blocks); the figure is the
best of --repeat runs of Replayer.run, and separately the LRU stack-depth pass the CLI adds.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

from controller import WritePolicy
from hicache.replay.core import Replayer, ReplaySetup
from hicache.replay.reuse import stack_depths
from hicache.replay.trace import read_trace

CASES = [
    ("GPU only, 10,000 blocks (LRU)", (10_000, 0, 0), WritePolicy()),
    ("GPU only, unlimited", (10**6, 0, 0), WritePolicy()),
    ("2k/5k/10k, write_through/write_through", (2_000, 5_000, 10_000), WritePolicy.eager()),
    ("2k/5k/10k, write_through/write_back", (2_000, 5_000, 10_000), WritePolicy.eager("write_back")),
    ("400/1k/3k, write_through/write_back", (400, 1_000, 3_000), WritePolicy.eager("write_back")),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="/work/shared/traces/mooncake_synthetic_trace.jsonl")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=0, help="pin to this core (one core)")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    trace = read_trace(args.trace)
    gc.freeze()  # as the CLI does
    blocks = trace.blocks
    print(f"trace: {args.trace}: {len(trace.records):,} requests, {blocks:,} blocks; pinned to CPU {args.cpu}")
    print("| case | total hit rate | best s | blocks/s |\n|---|---|---|---|")
    for name, (dev, host, disk), policy in CASES:
        best, rate = float("inf"), 0.0
        for _ in range(args.repeat):
            rep = Replayer(ReplaySetup(512, dev, host, disk, block_bytes=512 * 131072, write_policy=policy))
            start = time.perf_counter()
            totals = rep.run(trace.records)
            best = min(best, time.perf_counter() - start)
            rate = sum(totals.hit_blocks.values()) / totals.blocks
        print(f"| {name} | {rate:.1%} | {best:.2f} | {blocks / best:,.0f} |")
    best = min(_timed(lambda: stack_depths(trace.records)) for _ in range(args.repeat))
    print(f"| LRU stack-depth pass (CLI adds it once per trace) | - | {best:.2f} | {blocks / best:,.0f} |")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
