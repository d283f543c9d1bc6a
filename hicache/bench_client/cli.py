"""`hicache bench multiturn`: the multi-turn benchmark client; prints a table, optionally writes JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from typing import Any

from hicache.bench_client.multiturn import BenchError, MultiTurnOptions, run_multiturn
from hicache.bench_client.report import format_table


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` with its `multiturn` subcommand."""
    bench = sub.add_parser("bench", help="benchmark clients for OpenAI-compatible servers")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="KIND")
    p = kinds.add_parser("multiturn", help="multi-turn conversations: each prompt extends the previous one",
                         description="Each client's next prompt is its history plus the previous answer plus a "
                                     "new question (SGLang's multi-turn benchmark). Works against any "
                                     "OpenAI-compatible server.")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=8, help="concurrent conversations (default 8)")
    p.add_argument("--rounds", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--request-length", type=int, default=512, help="tokens per new question (default 512)")
    p.add_argument("--output-length", type=int, default=64, help="tokens per answer, forced (default 64)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="request starts per second, Poisson (default: inf, send when ready)")
    p.add_argument("--max-parallel", type=int, help="requests in flight at most (default: --clients)")
    p.add_argument("--round-barrier", action="store_true", help="start round r+1 only when every client ended r")
    p.add_argument("--seed", type=int, default=0, help="seed of the question text (default 0)")
    p.add_argument("--model", help="model id to request (default: the first of /v1/models)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="endpoint: /v1/completions with the concatenated history (default) or /v1/chat/completions")
    p.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY or $HICACHE_API_KEY)")
    p.add_argument("--chars-per-token", type=float,
                   help="characters per token of the server's tokenizer (default: measured with two probes)")
    p.add_argument("--no-extensions", action="store_true",
                   help="do not send ignore_eos / min_tokens (for servers that reject them; output may be shorter)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.set_defaults(func=run)


def _clean(obj: Any) -> Any:
    """NaN -> None, so the JSON is strict."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def run(args: argparse.Namespace) -> int:
    opts = MultiTurnOptions(
        url=args.url, clients=args.clients, rounds=args.rounds, request_length=args.request_length,
        output_length=args.output_length, request_rate=args.request_rate, max_parallel=args.max_parallel,
        round_barrier=args.round_barrier, seed=args.seed, model=args.model, api=args.api,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("HICACHE_API_KEY"),
        chars_per_token=args.chars_per_token, extensions=not args.no_extensions, temperature=args.temperature,
        timeout_s=args.timeout,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    try:
        report = asyncio.run(run_multiturn(opts))
    except BenchError as e:
        print(f"hicache bench: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    for line in report.errors[:5]:
        print(f"error: {line}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_clean(report.to_json()), f, indent=2)
    return 1 if report.errors else 0
