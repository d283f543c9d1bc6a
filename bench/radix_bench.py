"""match_prefix and insert throughput of the radix tree on a tree of 100k pages.

Builds a tree of conversations that share system prompts (as a multi-turn load does), then times
insert of new branches and match_prefix of existing prefixes. Prints pages/s and ops/s.

    python bench/radix_bench.py [--pages 100000] [--page-size 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from radix import RadixTree, namespace_fingerprint


def build_requests(pages: int, page_size: int, seed: int) -> list[list[int]]:
    """Requests of 8-64 pages: one of 50 system prompts (4-16 pages) plus a unique tail."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(50000) for _ in range(rng.randint(4, 16) * page_size)] for _ in range(50)]
    out, total = [], 0
    while total < pages:
        head = rng.choice(prompts)
        tail = [rng.randrange(50000) for _ in range(rng.randint(4, 48) * page_size)]
        out.append(head + tail)
        total += len(tail) // page_size
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    ps = args.page_size
    requests = build_requests(args.pages, ps, args.seed)
    tree = RadixTree(ps, namespace_fingerprint({"bench": 1}))
    next_page = 0
    t0 = time.perf_counter()
    inserted = 0
    for tokens in requests:
        n = len(tokens) // ps
        tree.insert(tokens, list(range(next_page, next_page + n)))
        next_page += n
        inserted += n
    insert_s = time.perf_counter() - t0
    tree_pages = tree.pages_in[0]
    t0 = time.perf_counter()
    matched = 0
    for tokens in requests:
        matched += tree.match_prefix(tokens).num_pages
    match_s = time.perf_counter() - t0
    tree.check_integrity()
    result = {
        "tree_pages": tree_pages,
        "requests": len(requests),
        "page_size": ps,
        "insert_pages_per_s": inserted / insert_s,
        "insert_requests_per_s": len(requests) / insert_s,
        "match_pages_per_s": matched / match_s,
        "match_requests_per_s": len(requests) / match_s,
    }
    for k, v in result.items():
        print(f"{k:>24}: {v:,.0f}" if isinstance(v, float) else f"{k:>24}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
