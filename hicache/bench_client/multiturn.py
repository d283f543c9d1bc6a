"""Multi-turn chat benchmark against any OpenAI-compatible server (httpx + stdlib only).

Each client holds a conversation: round r sends its history (every earlier question and answer) plus a
new question of about `request_length` tokens, and asks for exactly `output_length` tokens, as SGLang's
multi-turn benchmark does. So round r's prompt shares all of round r-1's prompt and answer: a
prefix cache serves it. Token counts come from the server's `usage`; the client cannot tokenize, so
it measures the server's characters per token once (two probe prompts) and sizes questions with it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from hicache.bench_client.report import BenchReport, TurnResult, build_report

# common short English words: ASCII, so a byte-level tokenizer gives one token per character
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()
METRIC_PREFIXES = ("hicache_cache_hit_tokens_total", "hicache_prompt_tokens_total", "hicache_pages_promoted_total",
                   "hicache_pages_demoted_total", "hicache_bytes_moved_total", "hicache_evictions_total",
                   "hicache_recomputed_tokens_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


@dataclass(frozen=True)
class MultiTurnOptions:
    url: str
    clients: int
    rounds: int
    request_length: int
    output_length: int
    request_rate: float = float("inf")  # requests per second (Poisson arrivals); inf = as fast as ready
    max_parallel: int | None = None
    round_barrier: bool = False
    seed: int = 0
    model: str | None = None
    api: str = "completions"  # or "chat"
    api_key: str | None = None
    chars_per_token: float | None = None  # None: measure it
    extensions: bool = True  # send ignore_eos / min_tokens (vLLM, SGLang, hicache accept them)
    temperature: float = 0.0
    timeout_s: float = 600.0


class ClientOptions(Protocol):
    """What `Client` reads of a benchmark's options."""

    model: str | None
    temperature: float
    extensions: bool


class BenchError(RuntimeError):
    """The benchmark could not run (server unreachable, no model, probe failed)."""


def random_text(rng: random.Random, chars: int) -> str:
    """Random words, about `chars` characters long."""
    words: list[str] = []
    n = 0
    while n < chars:
        word = rng.choice(WORDS)
        words.append(word)
        n += len(word) + 1
    return " ".join(words)[: max(chars, 1)]


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for the Prometheus text lines whose name starts with one of METRIC_PREFIXES."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(METRIC_PREFIXES):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """The change of each /metrics value over a run; None when the server has none."""
    if before is None or not after:
        return None
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def open_http(url: str, api_key: str | None, parallel: int, timeout_s: float) -> httpx.AsyncClient:
    """The HTTP client of a run: `parallel` requests in flight (plus /metrics), bearer token if given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=parallel + 2, max_keepalive_connections=parallel + 2)
    return httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                             timeout=httpx.Timeout(timeout_s, connect=10.0))


class Client:
    """Talks to the server: discovery, probes, one streamed request."""

    def __init__(self, opts: ClientOptions, http: httpx.AsyncClient):
        self.opts = opts
        self.http = http
        self.model = opts.model
        self.max_model_len: int | None = None  # the context limit /v1/models gives (vLLM, hicache), if any

    async def discover_model(self) -> str:
        """The model of /v1/models named --model, else the first; its max_model_len, if listed, is kept."""
        r = await self.http.get("/v1/models")
        if r.status_code != 200:
            raise BenchError(f"GET /v1/models: HTTP {r.status_code}: {r.text[:200]}")
        data = r.json().get("data") or []
        if not data:
            raise BenchError("GET /v1/models lists no model; pass --model")
        card = next((m for m in data if m.get("id") == self.model), data[0])
        limit = card.get("max_model_len")
        self.max_model_len = limit if isinstance(limit, int) and limit > 0 else None
        return card["id"]

    def sampling(self, max_tokens: int, stream: bool) -> dict[str, Any]:
        """The body fields of every request: model, exactly `max_tokens` answer tokens, streaming with usage."""
        o = self.opts
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": o.temperature,
                                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if o.extensions:
            body.update(ignore_eos=True, min_tokens=max_tokens)
        return body

    def body(self, history: list[dict[str, str]], max_tokens: int, stream: bool) -> tuple[str, dict[str, Any]]:
        """The endpoint and JSON body for a conversation (alternating user / assistant messages)."""
        o = self.opts
        body = self.sampling(max_tokens, stream)
        if o.api == "chat":
            return "/v1/chat/completions", {**body, "messages": history}
        # each message ends with a newline, and an answer follows its prompt directly, as it was generated
        return "/v1/completions", {**body, "prompt": "".join(m["content"] + "\n" for m in history)}

    async def prompt_tokens(self, text: str) -> int:
        path, body = self.body([{"role": "user", "content": text}], 1, stream=False)
        r = await self.http.post(path, json=body)
        if r.status_code != 200:
            raise BenchError(f"probe request: HTTP {r.status_code}: {r.text[:300]}")
        return int(r.json()["usage"]["prompt_tokens"])

    async def chars_per_token(self, rng: random.Random) -> float:
        """Characters per prompt token, from the token counts of a short and a long probe."""
        short, long = random_text(rng, 100), random_text(rng, 1000)
        a, b = await self.prompt_tokens(short), await self.prompt_tokens(long)
        if b <= a:
            raise BenchError(f"probe token counts make no sense ({a} for {len(short)} chars, {b} for {len(long)})")
        return (len(long) - len(short)) / (b - a)

    async def metrics(self) -> dict[str, float] | None:
        try:
            r = await self.http.get("/metrics")
        except httpx.HTTPError:
            return None
        return parse_metrics(r.text) if r.status_code == 200 else None

    async def turn(self, result: TurnResult, history: list[dict[str, str]], t0: float) -> str:
        """Send one streamed turn of a conversation; fill `result`; return the answer text."""
        path, body = self.body(history, self.opts.output_length, stream=True)
        return await self.stream(result, path, body, t0)

    async def stream(self, result: TurnResult, path: str, body: dict[str, Any] | bytes, t0: float) -> str:
        """POST one streamed request; fill `result` (TTFT, end, usage); return the answer text.

        body: the JSON body, or its encoding (large prompts: encoded before `result.start`, outside the TTFT).
        """
        answer: list[str] = []
        usage: dict[str, Any] | None = None
        send = ({"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes)
                else {"json": body})
        async with self.http.stream("POST", path, **send) as r:
            if r.status_code != 200:
                raise BenchError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise BenchError(str(chunk["error"].get("message", chunk["error"])))
                for choice in chunk.get("choices") or []:
                    # TTFT: the first chunk carrying a choice (servers send it when the first token exists,
                    # which may not decode to text yet, e.g. part of a multi-byte character)
                    if result.ttft is None:
                        result.ttft = time.perf_counter() - t0 - result.start
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        answer.append(text)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        result.end = time.perf_counter() - t0
        if usage is not None:
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            result.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = int(details.get("cached_tokens") or 0)
            per_tier = details.get("cached_tokens_per_tier")
            if isinstance(per_tier, dict):
                result.cached_per_tier = {k: int(v) for k, v in per_tier.items()}
        else:
            result.completion_tokens = len(answer)  # chunks: about one token each
        return "".join(answer)


class Pacer:
    """Poisson request starts at `rate` per second (inf: no waiting)."""

    def __init__(self, rate: float, rng: random.Random):
        self.rate = rate
        self.rng = rng
        self.next = time.perf_counter()

    async def wait(self) -> None:
        if self.rate == float("inf"):
            return
        now = time.perf_counter()
        self.next = max(self.next, now) + self.rng.expovariate(self.rate)
        await asyncio.sleep(max(0.0, self.next - now))


async def run_multiturn(opts: MultiTurnOptions) -> BenchReport:
    """Run the benchmark; BenchError if it cannot start (per-request failures are counted, not raised)."""
    if min(opts.clients, opts.rounds, opts.request_length, opts.output_length) < 1:
        raise BenchError("--clients, --rounds, --request-length and --output-length must be >= 1")
    parallel = opts.max_parallel or opts.clients
    rng = random.Random(opts.seed)
    async with open_http(opts.url, opts.api_key, parallel, opts.timeout_s) as http:
        client = Client(opts, http)
        try:
            client.model = opts.model or await client.discover_model()
            cpt = opts.chars_per_token or await client.chars_per_token(rng)
        except httpx.HTTPError as e:
            raise BenchError(f"{opts.url}: {e!r}") from None
        question_chars = max(1, round(opts.request_length * cpt))
        questions = [[random_text(random.Random(f"{opts.seed}/{c}/{r}"), question_chars) for r in range(opts.rounds)]
                     for c in range(opts.clients)]
        histories: list[list[dict[str, str]]] = [[] for _ in range(opts.clients)]
        alive = [True] * opts.clients
        turns: list[TurnResult] = []
        gate = asyncio.Semaphore(parallel)
        pacer = Pacer(opts.request_rate, rng)
        before = await client.metrics()
        t0 = time.perf_counter()

        async def one_turn(c: int, r: int) -> None:
            if not alive[c]:
                return
            await pacer.wait()
            async with gate:
                history = histories[c] + [{"role": "user", "content": questions[c][r]}]
                result = TurnResult(c, r, time.perf_counter() - t0)
                turns.append(result)
                try:
                    answer = await client.turn(result, history, t0)
                except (BenchError, httpx.HTTPError, ValueError, KeyError) as e:
                    result.end = time.perf_counter() - t0
                    result.error = str(e) or repr(e)
                    alive[c] = False  # the conversation cannot go on without this answer
                    return
                histories[c] = history + [{"role": "assistant", "content": answer}]

        async def conversation(c: int) -> None:
            for r in range(opts.rounds):
                await one_turn(c, r)

        if opts.round_barrier:
            for r in range(opts.rounds):
                await asyncio.gather(*(one_turn(c, r) for c in range(opts.clients)))
        else:
            await asyncio.gather(*(conversation(c) for c in range(opts.clients)))
        duration = time.perf_counter() - t0
        after = await client.metrics()
    deltas = metric_deltas(before, after)
    settings = {**{k: v for k, v in vars(opts).items() if k != "api_key"}, "model": client.model,
                "chars_per_token": cpt, "question_chars": question_chars}
    if settings["request_rate"] == float("inf"):
        settings["request_rate"] = None
    return build_report(settings, turns, duration, deltas)
