"""Coding-agent sessions replayed against any OpenAI-compatible server as token-id prompts (httpx + stdlib).

Each agent session (hicache/bench_client/workload.py: formats, sub-agents, id scopes, how prompts are built)
runs closed-loop: a request is sent when the session's previous one has answered, after its recorded
`think_time` times `think_scale` (capped at `max_think`; default scale 0: no waiting). Sessions start together,
at most `concurrency` at a time (a sub-agent runs inside its parent's slot). A Mooncake trace's requests are
one-request sessions arriving open-loop at `timestamp` times `time_scale`. Every request goes to
/v1/completions with `prompt` as token ids and asks for exactly min(out, `output_length`) tokens (`ignore_eos`
and `min_tokens` unless `extensions` is off), so runs on different servers are comparable. A request whose
prompt plus answer exceeds `max_context` (default: the server's `max_model_len` from /v1/models) is skipped and
counted, not truncated (a truncated prompt would make every later turn of its session a full hit). The prompts
do not depend on the answers, so a failed request is counted and its session goes on.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from hicache.bench_client.multiturn import BenchError, Client, metric_deltas, open_http
from hicache.bench_client.report import BenchReport, TurnResult, build_report
from hicache.bench_client.workload import PromptBuilder, Session, SessionTurn, load_traces


@dataclass(frozen=True)
class AgentOptions:
    url: str
    traces: tuple[str, ...] = ()
    output_length: int = 16  # answer tokens at most (min with the trace's `out`), forced
    think_scale: float = 0.0  # seconds waited before a request = think_time * think_scale (closed loop)
    max_think: float = 60.0  # cap on that wait
    time_scale: float = 1.0  # open loop (Mooncake): a request starts at timestamp * time_scale
    sessions: int | None = None  # the first K sessions of the traces
    concurrency: int | None = None  # sessions in flight at most (default: all)
    max_context: int | None = None  # skip requests whose prompt + answer exceed it (default: the server's limit)
    block_tokens: int | None = None  # tokens per hash id (default: the trace's block size)
    vocab: int = 32000  # token ids drawn from [100, vocab)
    seed: int = 0  # of the prompt tokens
    model: str | None = None
    api_key: str | None = None
    extensions: bool = True  # send ignore_eos / min_tokens
    temperature: float = 0.0
    timeout_s: float = 600.0


@dataclass
class _Skipped:
    session: str
    turn: int
    tokens: int


async def run_agent(opts: AgentOptions, sessions: list[Session] | None = None) -> BenchReport:
    """Replay `sessions` (default: those of `opts.traces`); BenchError if the run cannot start.

    TraceError (a ValueError) if a trace cannot be read. Per-request failures are counted, not raised.
    """
    if sessions is None:
        sessions = load_traces(opts.traces)
    if opts.sessions is not None:
        sessions = sessions[: opts.sessions]
    if not sessions:
        raise BenchError("no sessions to run")
    if opts.output_length < 1 or (opts.concurrency is not None and opts.concurrency < 1):
        raise BenchError("--output-length and --concurrency must be >= 1")
    if min(opts.think_scale, opts.max_think, opts.time_scale) < 0:
        raise BenchError("--think-scale, --max-think and --time-scale must be >= 0")
    try:
        builder = PromptBuilder(opts.vocab, opts.seed, opts.block_tokens)
    except ValueError as e:
        raise BenchError(str(e)) from None
    flat = [s for top in sessions for s in top.walk()]
    number = {id(s): i for i, s in enumerate(flat)}
    turns: list[TurnResult] = []
    skipped: list[_Skipped] = []
    async with open_http(opts.url, opts.api_key, len(flat), opts.timeout_s) as http:
        client = Client(opts, http)
        try:
            try:
                discovered = await client.discover_model()
            except BenchError:
                if not opts.model:
                    raise
                discovered = None
        except httpx.HTTPError as e:
            raise BenchError(f"{opts.url}: {e!r}") from None
        client.model = opts.model or discovered
        max_context = opts.max_context or client.max_model_len
        gate = asyncio.Semaphore(opts.concurrency or len(sessions))

        async def request(s: Session, req: SessionTurn) -> None:
            prompt = builder.prompt(s, req)
            max_tokens = max(1, min(req.output_length, opts.output_length))
            if max_context is not None and len(prompt) + max_tokens > max_context:
                skipped.append(_Skipped(s.name, req.index, len(prompt)))
                return
            body = json.dumps({**client.sampling(max_tokens, stream=True), "prompt": prompt},
                              separators=(",", ":")).encode()
            result = TurnResult(number[id(s)], req.index, time.perf_counter() - t0)
            turns.append(result)
            try:
                await client.stream(result, "/v1/completions", body, t0)
            except (BenchError, httpx.HTTPError, ValueError, KeyError) as e:
                result.end = time.perf_counter() - t0
                result.error = str(e) or repr(e)

        async def session(s: Session, top: bool) -> None:
            first = top  # a top-level session starts at once (or at its arrival): no think before it
            for step in s.steps:
                if isinstance(step, list):  # sub-agents, started together; the parent waits for all
                    await asyncio.gather(*(session(sub, False) for sub in step))
                    continue
                wait = 0.0 if first else min(step.think_time * opts.think_scale, opts.max_think)
                first = False
                if wait > 0:
                    await asyncio.sleep(wait)
                await request(s, step)

        async def start(s: Session) -> None:
            if s.arrival is not None:
                await asyncio.sleep(max(0.0, t0 + s.arrival * opts.time_scale - time.perf_counter()))
            async with gate:
                await session(s, True)

        before = await client.metrics()
        t0 = time.perf_counter()
        await asyncio.gather(*(start(s) for s in sessions))
        duration = time.perf_counter() - t0
        after = await client.metrics()
    settings = {**{k: v for k, v in vars(opts).items() if k != "api_key"}, "traces": list(opts.traces),
                "model": client.model, "max_context": max_context, "sessions": len(sessions),
                "subagent_sessions": len(flat) - len(sessions)}
    report = build_report(settings, turns, duration, metric_deltas(before, after))
    report.errors = [f"session {flat[t.client].name} turn {t.round}: {t.error}" for t in turns if t.error]
    report.overall["sessions"] = len(flat)
    report.overall["skipped_requests"] = len(skipped)
    report.overall["skipped"] = [vars(k) for k in skipped[:20]]
    return report
