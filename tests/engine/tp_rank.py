"""One tensor-parallel rank (gloo, CPU) for tests/engine/test_tp.py: shard a model, run a prompt and a few greedy
steps on this rank's KV pool, and (rank 0) write the logits and tokens to a file.

    python tp_rank.py MODEL RANK SIZE PORT OUT [--die-after-steps N]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hicache.engine.model import ForwardBatch  # noqa: E402
from hicache.engine.tp.shard import TPShard, shard_model  # noqa: E402
from hicache.engine.weights import load_model  # noqa: E402

PAGE = 4
PROMPT = [7, 99, 3, 250, 11, 42, 42, 5, 17, 301, 77, 2, 9, 120, 64]
STEPS = 6


def run(model, kv: torch.Tensor, die_after: int | None) -> tuple[torch.Tensor, list[int]]:
    tokens, ids, first = list(PROMPT), [], None
    start = 0
    for step in range(STEPS):
        if die_after is not None and step == die_after:
            os._exit(3)  # a rank that dies mid-request
        n = len(tokens)
        positions = torch.arange(start, n)
        batch = ForwardBatch(torch.tensor(tokens[start:]), positions, positions, [n], [n - start],
                             [torch.arange(-(-n // PAGE))])
        logits = model(batch, kv, PAGE)[-1]
        first = logits if first is None else first
        ids.append(int(logits.argmax()))
        start = n
        tokens.append(ids[-1])
    return first, ids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("rank", type=int)
    p.add_argument("size", type=int)
    p.add_argument("port", type=int)
    p.add_argument("out")
    p.add_argument("--die-after-steps", type=int)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--whole-then-cut", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.size, timeout=datetime.timedelta(seconds=args.timeout_s))
    if args.size == 1:
        shard = None
    elif args.whole_then_cut:  # load every tensor whole, then cut the model (shard_model on its own)
        shard = functools.partial(shard_model, rank=args.rank, size=args.size)
    else:  # each tensor loaded already cut
        shard = TPShard(args.rank, args.size)
    model, _ = load_model(args.model, torch.float32, torch.device("cpu"), shard=shard)
    kv = torch.zeros(model.kv_pool_shape(16, PAGE))
    die = args.die_after_steps if args.rank == args.size - 1 else None
    try:
        logits, ids = run(model, kv, die)
    except Exception as e:  # noqa: BLE001 - what the test checks: the error, not a hang
        print(f"rank {args.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(4)
    if args.rank == 0:
        torch.save({"logits": logits, "ids": ids, "kv_heads": model.config.num_kv_heads}, args.out)
    if args.size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
