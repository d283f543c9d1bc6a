"""TTFT of a prompt whose prefix sits on L3, against recomputing it (bench/RESULTS.md, 'L3 prefix vs recompute').

Against a running server: send prompt P (unique, --prefix-tokens long) once, then --evictors other
prompts of the same length so P's pages leave the GPU and host tiers (the server must be sized so),
then P again plus a short new question, timing the first token (streaming). Prints and writes JSON
with the TTFT, cached tokens per tier of the final request, and the server's /metrics hit counters.

    python bench/gpu/l3_vs_recompute.py --url URL --prefix-tokens 8192 --evictors 6 --json OUT
"""

from __future__ import annotations

import argparse
import json
import random
import time

import httpx


def text_of(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["alpha", "bravo", "delta", "gamma", "omega", "sigma", "theta", "kappa", "lambda", "zeta"]
    out, n = [], 0
    while n < tokens:
        w = rng.choice(words) + str(rng.randrange(1000))
        out.append(w)
        n += len(w) + 1  # byte-level tokenizer of the random models: ~1 token per character
    return " ".join(out)[:tokens]


def request(client: httpx.Client, url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage = None, None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft_s": ttft, "usage": usage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--evictors", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="repeat with new prefixes; medians are reported")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    rounds = []
    with httpx.Client(timeout=600) as client:
        model = client.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        for r in range(args.rounds):
            seed = args.seed + 7919 * r
            prefix = text_of(args.prefix_tokens, seed)
            first = request(client, args.url, model, prefix + " first question?")
            for i in range(args.evictors):
                request(client, args.url, model, text_of(args.prefix_tokens, 1000 + seed * 100 + i))
            final = request(client, args.url, model, prefix + " second question?")
            rounds.append({"first": first, "final": final})
            print(f"round {r}: first {first['ttft_s']:.3f} s, final {final['ttft_s']:.3f} s, cached "
                  f"{final['usage']['prompt_tokens_details']}", flush=True)

    def median(key: str) -> float:
        values = sorted(r[key]["ttft_s"] for r in rounds)
        return values[len(values) // 2]

    result = {"prefix_tokens": args.prefix_tokens, "rounds": rounds,
              "median_first_ttft_s": median("first"), "median_final_ttft_s": median("final"),
              "first": rounds[0]["first"], "final": rounds[0]["final"]}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
