"""Engine smoke test on any device: a mixed random:tiny workload with host tier and preemption.

Checks controller integrity after every step and that no page leaks. Usage:
    python bench/engine_sched_smoke.py --device cuda
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

from hicache.config import Config, override
from hicache.engine.builder import build_engine
from hicache.engine.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--page-size", type=int, default=4, help="16 or more runs decode through the Triton kernel")
    ap.add_argument("--graphs", type=int, default=0, help="model.cuda_graph_max_batch (CUDA, page size >= 16)")
    ap.add_argument("--load-mode", default="auto", choices=["auto", "always", "never"],
                    help="cache.load_policy.mode (on a GPU, auto recomputes random:tiny's cheap pages)")
    args = ap.parse_args()
    cfg = override(Config(), {
        "model.name": "random:tiny", "model.device": args.device, "cache.page_size": args.page_size,
        "cache.device": {"size_tokens": 40 * args.page_size}, "cache.host": {"size_tokens": 128 * args.page_size},
        "scheduler.chunk_tokens": 48, "scheduler.max_running_requests": 6,
        "model.cuda_graph_max_batch": args.graphs, "cache.load_policy.mode": args.load_mode,
    })
    engine = build_engine(cfg)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 250) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    pending = [(f"q{i}", rng.choice(prefixes) + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 20))],
                SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=rng.randrange(1, 12)))
               for i in range(args.requests)]
    done, start = 0, time.perf_counter()
    greedy: dict[str, list[int]] = {}  # request id -> tokens of temperature-0 requests
    temperature = {rid: params.temperature for rid, _, params in pending}
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                engine.add_request(*pending.pop(0))
        for out in engine.step():
            done += out.finished
            if temperature.get(out.request_id) == 0.0:
                greedy.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.cache.controller.check_integrity()
    ctrl = engine.cache.controller
    assert done == args.requests and not ctrl.commits.private
    assert ctrl.device.used_pages() == len(ctrl.tree.owned_pages("device"))
    stats = engine.stats()
    digest = hashlib.sha1(repr(sorted(greedy.items())).encode()).hexdigest()[:12]
    print(f"ok: {done} requests in {time.perf_counter() - start:.2f}s on {args.device}; "
          f"preemptions {stats['preemptions']}, hits {stats['cache']['hit_tokens']}, "
          f"evictions {stats['cache']['evictions']}; graph steps {stats['engine']['graph_steps']} of "
          f"{stats['engine']['steps']}; greedy outputs digest {digest}")
    engine.close()


if __name__ == "__main__":
    main()
