"""Write a multi-turn trace in Mooncake format: conversations taking turns in a fixed order, each turn resending its
history plus a new question (the shape of `hicache bench multiturn` in bench/RESULTS.md, 'Multi-turn TTFT, host tier
vs GPU only'), for `hicache replay`. Blocks of --block-tokens tokens; the last, partial block of a turn is unique to
that turn (its tokens change when the next turn fills it).

    python bench/multiturn_trace.py --out /tmp/mt32x8.jsonl   # 32 x 8 rounds x (1,024 + 8) tokens, 64-token blocks
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--request-length", type=int, default=1024)
    ap.add_argument("--output-length", type=int, default=8)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--gap-ms", type=int, default=100, help="time between consecutive requests")
    args = ap.parse_args()
    b = args.block_tokens
    with open(args.out, "w") as out:
        for r in range(args.rounds):
            for c in range(args.clients):
                length = (r + 1) * args.request_length + r * args.output_length
                ids = [c * 1_000_000 + i for i in range(length // b)]
                if length % b:
                    ids.append(2_000_000_000 + r * args.clients + c)  # this turn's partial block
                out.write(json.dumps({"timestamp": (r * args.clients + c) * args.gap_ms, "input_length": length,
                                      "output_length": args.output_length, "hash_ids": ids}) + "\n")


if __name__ == "__main__":
    main()
