"""`hicache bench multiturn | agent | agent-gen`: benchmark clients; print a table, optionally write JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from hicache.bench_client.agent import AgentOptions, run_agent
from hicache.bench_client.multiturn import BenchError, MultiTurnOptions, run_multiturn
from hicache.bench_client.report import BenchReport, format_table
from hicache.bench_client.workload import GenParams, describe, read_agent_json, synthesize, write_sessions
from hicache.replay.trace import TraceError


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` with its `multiturn`, `agent` and `agent-gen` subcommands."""
    bench = sub.add_parser("bench", help="benchmark clients for OpenAI-compatible servers")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="KIND")
    p = kinds.add_parser("multiturn", help="multi-turn conversations: each prompt extends the previous one",
                         description="Each client's next prompt is its history plus the previous answer plus a "
                                     "new question (SGLang's multi-turn benchmark). Works against any "
                                     "OpenAI-compatible server.")
    p.add_argument("--clients", type=int, default=8, help="concurrent conversations (default 8)")
    p.add_argument("--rounds", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--request-length", type=int, default=512, help="tokens per new question (default 512)")
    p.add_argument("--output-length", type=int, default=64, help="tokens per answer, forced (default 64)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="request starts per second, Poisson (default: inf, send when ready)")
    p.add_argument("--max-parallel", type=int, help="requests in flight at most (default: --clients)")
    p.add_argument("--round-barrier", action="store_true", help="start round r+1 only when every client ended r")
    p.add_argument("--seed", type=int, default=0, help="seed of the question text (default 0)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="endpoint: /v1/completions with the concatenated history (default) or /v1/chat/completions")
    p.add_argument("--chars-per-token", type=float,
                   help="characters per token of the server's tokenizer (default: measured with two probes)")
    _client_args(p)
    p.set_defaults(func=run)

    a = kinds.add_parser("agent", help="replay coding-agent sessions (or a Mooncake trace) as token-id prompts",
                         description="Replay agent sessions closed-loop (each request after the previous answer, "
                                     "plus think time if --think-scale) or a Mooncake JSONL trace open-loop, with "
                                     "prompts as token ids built from the hash ids (equal ids, equal tokens). "
                                     "Works against any OpenAI-compatible server that takes token-id prompts.")
    a.add_argument("traces", nargs="+", metavar="TRACE",
                   help="agent session JSON file, directory of them, or Mooncake JSONL file")
    a.add_argument("--output-length", type=int, default=16, metavar="N",
                   help="answer tokens: min(the trace's out, N), forced (default 16)")
    a.add_argument("--think-scale", type=float, default=0.0, metavar="X",
                   help="wait think_time * X before each request of a session (default 0: none)")
    a.add_argument("--max-think", type=float, default=60.0, metavar="S", help="longest such wait, seconds (default 60)")
    a.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="Mooncake traces: a request starts at its timestamp * X (default 1; 0: all at once)")
    a.add_argument("--sessions", type=int, metavar="K", help="replay the first K sessions (default: all)")
    a.add_argument("--concurrency", type=int, metavar="C", help="sessions in flight at most (default: all at once)")
    a.add_argument("--max-context", type=int, metavar="N",
                   help="skip requests whose prompt + answer exceed N tokens (default: the server's "
                        "max_model_len, when /v1/models gives it)")
    a.add_argument("--block-tokens", type=int, metavar="N",
                   help="tokens per hash id (default: the trace's block size); other values scale every length")
    a.add_argument("--vocab", type=int, default=32000, metavar="N",
                   help="token ids are drawn from [100, N) (default 32000)")
    a.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens (default 0)")
    _client_args(a)
    a.set_defaults(func=run_agent_cmd)

    g = kinds.add_parser("agent-gen", help="write synthetic agent sessions with the sample traces' statistics",
                         description="Write agent session JSON files (the format `bench agent` replays): contexts, "
                                     "appends, rewrites, think and output tokens drawn from distributions fitted to "
                                     "the sample sessions (hicache/bench_client/workload.py). Deterministic by "
                                     "--seed; session i is the same whatever --sessions.")
    g.add_argument("--sessions", type=int, default=12, help="sessions to write (default 12)")
    g.add_argument("--out", help="directory to write them into (one SESSION_ID.json each)")
    g.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    g.add_argument("--turns", type=_span, default=GenParams.turns, metavar="MIN:MAX",
                   help="requests per session, uniform (default 8:12)")
    g.add_argument("--context", type=_span, default=GenParams.context, metavar="MIN:MAX",
                   help="first prompt's tokens, log-uniform (default 15000:60000)")
    g.add_argument("--describe", nargs="+", metavar="TRACE",
                   help="instead: print the statistics the generator fits, of agent JSON files or directories")
    g.set_defaults(func=run_agent_gen)


def _client_args(p: argparse.ArgumentParser) -> None:
    """The flags every client has: server, model, auth, extensions, sampling, timeout, JSON output."""
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model id to request (default: the first of /v1/models)")
    p.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY or $HICACHE_API_KEY)")
    p.add_argument("--no-extensions", action="store_true",
                   help="do not send ignore_eos / min_tokens (for servers that reject them; output may be shorter)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")


def _span(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        span = (int(lo), int(hi or lo)) if sep or lo else None
    except ValueError:
        span = None
    if span is None or not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return span


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("HICACHE_API_KEY")


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
        round_barrier=args.round_barrier, seed=args.seed, model=args.model, api=args.api, api_key=_api_key(args),
        chars_per_token=args.chars_per_token, extensions=not args.no_extensions, temperature=args.temperature,
        timeout_s=args.timeout,
    )
    return _finish(args, lambda: run_multiturn(opts))


def run_agent_cmd(args: argparse.Namespace) -> int:
    opts = AgentOptions(
        url=args.url, traces=tuple(args.traces), output_length=args.output_length, think_scale=args.think_scale,
        max_think=args.max_think, time_scale=args.time_scale, sessions=args.sessions, concurrency=args.concurrency,
        max_context=args.max_context, block_tokens=args.block_tokens, vocab=args.vocab, seed=args.seed,
        model=args.model, api_key=_api_key(args), extensions=not args.no_extensions, temperature=args.temperature,
        timeout_s=args.timeout,
    )
    return _finish(args, lambda: run_agent(opts), label="turn")


def _finish(args: argparse.Namespace, bench: Any, label: str = "round") -> int:
    """Run `bench()` (a coroutine factory); print the table and the first errors; write --json."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    try:
        report: BenchReport = asyncio.run(bench())
    except (BenchError, TraceError) as e:
        print(f"hicache bench: {e}", file=sys.stderr)
        return 2
    o = report.overall
    if "skipped_requests" in o:
        print(f"{o['sessions']} sessions ({report.settings['subagent_sessions']} of them sub-agents), "
              f"{o['requests']} requests, {o['prompt_tokens']:,} prompt tokens, {o['duration_s']:.1f} s; "
              f"{o['skipped_requests']} skipped (prompt + answer over {report.settings['max_context']} tokens)")
    print(format_table(report, label))
    for line in report.errors[:5]:
        print(f"error: {line}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_clean(report.to_json()), f, indent=2)
    return 1 if report.errors else 0


def run_agent_gen(args: argparse.Namespace) -> int:
    try:
        if args.describe:
            print(json.dumps(_clean(describe(read_agent_json(args.describe))), indent=2))
            return 0
        if not args.out or args.sessions < 1:
            print("hicache bench agent-gen: --out DIR and --sessions >= 1 are needed (or --describe)", file=sys.stderr)
            return 2
    except TraceError as e:
        print(f"hicache bench agent-gen: {e}", file=sys.stderr)
        return 2
    sessions = synthesize(args.sessions, args.seed, GenParams(turns=args.turns, context=args.context))
    paths = write_sessions(sessions, args.out)
    lengths = [r["in"] for s in sessions for r in s["requests"]]
    print(f"wrote {len(paths)} sessions, {len(lengths)} requests, prompts {min(lengths):,}-{max(lengths):,} tokens, "
          f"to {Path(args.out)}")
    return 0
