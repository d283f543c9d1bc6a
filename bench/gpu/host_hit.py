"""TTFT of a lone request whose long prefix is on the GPU, in host memory, on disk, or nowhere (bench/RESULTS.md,
'A host hit against a GPU hit').

Against a running server, one round per fresh prefix P (--prefix-tokens long): P + a question computes it; then,
each timed at its first streamed token, with --new-tokens new tokens after P:
- gpu:       P again at once (its pages are still on the GPU);
- host:      after --gpu-evictors other prompts of P's length push P out of the GPU (the host tier keeps it);
- disk:      after --host-evictors more push it out of host memory too (the L3 keeps it; 0: skipped);
- recompute: a prompt of the same shape nobody sent before.
With --settle-s the host hit waits that long after the evictors: their GPU -> host copies, started when the pool
filled or the engine idled, are then done, and the GPU pages the hit loads into need not wait for them.
Each request's cached tokens per tier are recorded, so an arm whose prefix did not come from where it says shows.

    python bench/gpu/host_hit.py --url URL --prefix-tokens 32768 --new-tokens 1024 --gpu-evictors 3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
from l3_vs_recompute import request, text_of


def timed(client: httpx.Client, url: str, model: str, prompt: str) -> dict:
    r = request(client, url, model, prompt)
    details = (r["usage"] or {}).get("prompt_tokens_details") or {}
    return {"ttft_s": r["ttft_s"], "cached": details}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prefix-tokens", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--gpu-evictors", type=int, default=3)
    ap.add_argument("--host-evictors", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="pause after the evictors, so that their write-through copies to host have finished")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--json")
    args = ap.parse_args()
    rounds = []
    with httpx.Client(timeout=600) as client:
        model = client.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        for r in range(args.rounds):
            seed = args.seed + 7919 * r
            prefix = text_of(args.prefix_tokens, seed)

            def new(k: int, seed: int = seed) -> str:
                return " " + text_of(args.new_tokens - 1, seed * 10 + k)

            def evict(n: int, k: int, seed: int = seed) -> None:
                for i in range(n):
                    request(client, args.url, model, text_of(args.prefix_tokens, seed * 100 + k + i))

            timed(client, args.url, model, prefix + new(0))
            one = {"gpu": timed(client, args.url, model, prefix + new(1))}
            evict(args.gpu_evictors, 10)
            time.sleep(args.settle_s)
            one["host"] = timed(client, args.url, model, prefix + new(2))
            if args.host_evictors:
                evict(args.host_evictors, 50)
                one["disk"] = timed(client, args.url, model, prefix + new(3))
            one["recompute"] = timed(client, args.url, model, text_of(args.prefix_tokens, seed + 3) + new(4))
            rounds.append(one)
            print(f"round {r}: " + ", ".join(f"{k} {v['ttft_s'] * 1000:.1f} ms {v['cached']}" for k, v in one.items()),
                  flush=True)
    medians = {key: statistics.median_high(r[key]["ttft_s"] for r in rounds) for key in rounds[0]}
    ratios = {k: v / medians["gpu"] for k, v in medians.items()}
    result = {"prefix_tokens": args.prefix_tokens, "new_tokens": args.new_tokens, "median_ttft_s": medians,
              "vs_gpu_hit": ratios, "rounds": rounds}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
