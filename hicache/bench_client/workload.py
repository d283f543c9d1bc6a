"""Agent-session workloads for `hicache bench agent`: traces read into sessions, token-id prompts, a generator.

Formats read (`load_traces`):

- agent session JSON (kv-cache-tester's traces, ../shared/traces/agent/): one session per file, `block_size`
  tokens per hash id (64), `requests` in time order with `in`, `out`, `hash_ids` (one id per FULL block of the
  input), `think_time` (seconds the agent spent before sending it), `t`; an entry of `type` "subagent" holds its own
  `requests`. Each session replays closed-loop. A sub-agent becomes a session of its own (its own closed loop,
  reported under its own index), started when its parent reaches it; consecutive sub-agent entries start together
  and the parent's next request waits for all of them (as kv-cache-tester replays them). Id scope: with
  `hash_id_scope` "local" ids are unique per trace FILE, and a sub-agent shares its parent's file, so an id the
  parent and a sub-agent both send (the system prompt, tool definitions) is the same block and may hit the cache;
  two files never share a block. With "global" every file of the run shares one scope.
- Mooncake JSONL (and hicache's --trace-log): every line is an independent one-request session arriving open-loop
  at its `timestamp`; ids are global across the file (the file is the scope).

Prompts (`PromptBuilder`): block id b of scope s becomes `block_tokens` token ids drawn by a RNG seeded with
(seed, s, b) from [100, vocab) (ids below 100 are left to special tokens), so equal ids give equal tokens (a shared
prefix is a prefix-cache hit) and different scopes never collide. A prompt is its blocks' tokens trimmed to the
request's length; input beyond the last full block (agent traces list full blocks only) is filled with tokens unique
to that request. `block_tokens` other than the trace's scales the replay: lengths become
round(in * block_tokens / block_size), so a 64-token-block trace replays at 8 tokens a block with 1/8 the context.

Generator (`synthesize`): sessions in the agent JSON format with the statistics measured on the seven sample
sessions (`describe`, `hicache bench agent-gen --describe ../shared/traces/agent`), not their sizes:

- 7 sessions, 132 requests (10-31 per session), 125 transitions; initial contexts 9,691-22,945 tokens (median
  13,707), final 16,289-56,109. The generator draws the initial context log-uniform from `context` (default
  15,000-60,000 tokens: larger workloads than the samples) and the turn count uniform from `turns` (default 8-12).
- Appended tokens per turn (122 turns that extend the previous prompt): 114-22,387, p10 188, median 557, p90 4,070;
  log-normal fit mu 6.549, sigma 1.159 (of ln tokens; median 699, mean of the samples 1,528). Drawn from that
  log-normal, clipped to [64, 16,384] (one block; the fit's p99.7).
- Rewrites: in 6 of the 122 the previous prompt's last full block changed (p 0.049): the new prompt drops it. In 3
  of the 125 the prompt kept only part of the previous one (compaction, an edit, a new conversation: 0, 32% and 91%
  of its blocks kept; the new prompt as long as the old within 3%): p 0.024, the kept fraction uniform in [0, 1),
  and the new prompt is the old length plus an append. No sub-agents in the samples (`totals.subagent_count` 0 in
  all seven), so the generator writes none.
- Think time before a turn (102 turns that extend the previous prompt and record it): 2-1,795 s, median 6 s, p90
  76 s; a two-part log-normal fit split at 60 s: 87.3% short turns, mu 1.880 sigma 0.741 (median 6.6 s), 12.7%
  pauses, mu 5.599 sigma 1.180 (median 270 s). (The three rewrites above followed pauses of 1,332-48,547 s.)
- Output tokens (132 requests): 70-4,653, median 189; log-normal mu 5.388 sigma 0.871, clipped to [1, 8,192]. The
  replayer caps answers (`--output-length`), so this only fills `out`.
- API time (the recorded server time, for `t` only): least squares over the 111 requests that record it,
  2.39 s + out / 56.5 tokens/s.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hicache.replay.agent import AgentSession, parse_agent_session
from hicache.replay.trace import TraceError, parse_lines

BLOCK_SIZE = 64  # tokens per hash id in agent traces
FIRST_TOKEN = 100  # token ids below this are left to special tokens
PAUSE_S = 60.0  # think times above this count as pauses in `describe`'s fit


@dataclass
class SessionTurn:
    """One request of a session; lengths in the trace's tokens."""

    index: int  # position among its session's requests
    input_length: int
    output_length: int
    hash_ids: list[Any]
    think_time: float = 0.0  # seconds between the previous answer and this request (closed loop)


@dataclass
class Session:
    """A closed-loop sequence of requests; a list in `steps` is a group of sub-agents started together."""

    name: str
    scope: str  # equal (scope, hash id) = equal block
    block_size: int
    steps: list[SessionTurn | list[Session]] = field(default_factory=list)
    arrival: float | None = None  # open loop: seconds from the run's start (before --time-scale); None: at once

    def requests(self) -> list[SessionTurn]:
        return [s for s in self.steps if isinstance(s, SessionTurn)]

    def walk(self) -> Iterator[Session]:
        """This session and every sub-agent below it, depth first."""
        yield self
        for step in self.steps:
            if isinstance(step, list):
                for sub in step:
                    yield from sub.walk()


# ---------------------------------------------------------------------- reading traces


def _agent_session(obj: dict[str, Any], name: str, scope: str, block_size: int, where: str) -> Session:
    """A session file's object as a closed-loop Session (hicache/replay/agent.py parses and checks it)."""
    return _session(parse_agent_session(obj, block_size, where), name, scope, block_size)


def _session(parsed: AgentSession, name: str, scope: str, block_size: int) -> Session:
    """A parsed session's turns with their think times (AgentTurn.think_s), its sub-agents as sessions of their
    own, named after their parent."""
    session = Session(name, scope, block_size)
    subagents = 0
    for step in parsed.steps:
        if isinstance(step, list):
            group = []
            for sub in step:
                subagents += 1
                sub_name = f"{name}/sa{subagents}" + (f"-{sub.agent_id}" if sub.agent_id else "")
                group.append(_session(sub, sub_name, scope, block_size))
            session.steps.append(group)
            continue
        session.steps.append(SessionTurn(len(session.requests()), step.input_length, step.output_length,
                                         step.hash_ids, step.think_s))
    return session


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl") and p.is_file())
        if not files:
            raise TraceError(f"{path}: no .json or .jsonl files")
        return files
    return [path]


def load_traces(paths: Sequence[str | Path]) -> list[Session]:
    """Sessions of agent JSON files, directories of them and Mooncake JSONL files, in the order given (a
    directory's files sorted by name). TraceError names the file when one cannot be read."""
    sessions: list[Session] = []
    scopes: set[str] = set()
    for path in (f for p in paths for f in _files(Path(p))):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TraceError(f"{path}: cannot read: {e}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None  # several lines: JSONL
        if isinstance(obj, dict) and "requests" in obj:
            name = str(obj.get("id") or path.stem)
            scope = name
            while scope in scopes:  # two files with one id: still separate scopes
                scope += "+"
            scopes.add(scope)
            if obj.get("hash_id_scope") == "global":
                scope = "global"
            block_size = obj.get("block_size", BLOCK_SIZE)
            if not isinstance(block_size, int) or block_size < 1:
                raise TraceError(f"{path}: block_size must be a positive integer")
            sessions.append(_agent_session(obj, name, scope, block_size, str(path)))
            continue
        trace = parse_lines(text.splitlines(), str(path), strict=True)
        scope = f"{trace.format}:{path.name}"
        for rec in trace.records:
            req = SessionTurn(0, rec.input_length, rec.output_length, rec.hash_ids)
            sessions.append(Session(f"{path.stem}:{rec.line}", scope, trace.block_tokens, [req],
                                    arrival=rec.timestamp_ms / 1000.0))
    if not sessions:
        raise TraceError("no sessions in " + ", ".join(map(str, paths)))
    if any(s.arrival is not None for s in sessions):
        start = min(s.arrival for s in sessions if s.arrival is not None)
        for s in sessions:
            if s.arrival is not None:
                s.arrival -= start
    return sessions


# ---------------------------------------------------------------------- prompts


class PromptBuilder:
    """Token ids for requests: equal (scope, hash id) -> equal tokens; see the module docstring."""

    def __init__(self, vocab: int = 32000, seed: int = 0, block_tokens: int | None = None):
        if vocab <= FIRST_TOKEN:
            raise ValueError(f"vocab must be above {FIRST_TOKEN}, got {vocab}")
        if block_tokens is not None and block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.ids = range(FIRST_TOKEN, vocab)
        self.seed = seed
        self.block_tokens = block_tokens
        self._blocks: dict[tuple[str, Any], list[int]] = {}

    def tokens_per_block(self, session: Session) -> int:
        return self.block_tokens or session.block_size

    def length(self, session: Session, req: SessionTurn) -> int:
        """The prompt's length in tokens: the trace's, scaled when block_tokens differs from its block size."""
        return max(1, round(req.input_length * self.tokens_per_block(session) / session.block_size))

    def _random(self, key: str, n: int) -> list[int]:
        return random.Random(f"{self.seed}/{key}").choices(self.ids, k=n)

    def block(self, scope: str, block_id: Any, n: int) -> list[int]:
        key = (scope, block_id)
        tokens = self._blocks.get(key)
        if tokens is None or len(tokens) != n:
            tokens = self._blocks[key] = self._random(f"{scope}/{block_id!r}", n)
        return tokens

    def prompt(self, session: Session, req: SessionTurn) -> list[int]:
        n, length = self.tokens_per_block(session), self.length(session, req)
        out: list[int] = []
        for block_id in req.hash_ids:
            if len(out) >= length:
                break
            out += self.block(session.scope, block_id, n)
        if len(out) < length:  # past the last full block: tokens of this request only
            out += self._random(f"{session.scope}/{session.name}/{req.index}/tail", length - len(out))
        return out[:length]


# ---------------------------------------------------------------------- the generator


@dataclass(frozen=True)
class GenParams:
    """The generator's distributions (module docstring: what they were fitted to)."""

    turns: tuple[int, int] = (8, 12)  # requests per session, uniform
    context: tuple[int, int] = (15_000, 60_000)  # first prompt's tokens, log-uniform
    append_mu: float = 6.549  # ln tokens appended per turn, normal
    append_sigma: float = 1.159
    append_clip: tuple[int, int] = (64, 16_384)
    tail_rewrite_p: float = 0.049  # the previous prompt's last full block is replaced
    rewrite_p: float = 0.024  # only a uniform fraction of the previous prompt's blocks is kept
    think_pause_p: float = 0.127
    think_mu: float = 1.880  # ln seconds of a short think, normal
    think_sigma: float = 0.741
    pause_mu: float = 5.599  # ln seconds of a pause, normal
    pause_sigma: float = 1.180
    out_mu: float = 5.388  # ln output tokens, normal
    out_sigma: float = 0.871
    out_clip: tuple[int, int] = (1, 8192)
    api_base_s: float = 2.39  # recorded API time = base + out / rate (only for `t`)
    api_tokens_per_s: float = 56.5
    block_size: int = BLOCK_SIZE

    def __post_init__(self) -> None:
        lo, hi = self.turns
        if not 1 <= lo <= hi:
            raise ValueError(f"turns must be 1 <= MIN <= MAX, got {lo}:{hi}")
        lo, hi = self.context
        if not 1 <= lo <= hi:
            raise ValueError(f"context must be 1 <= MIN <= MAX, got {lo}:{hi}")


def _lognormal(rng: random.Random, mu: float, sigma: float, clip: tuple[int, int]) -> int:
    return int(min(clip[1], max(clip[0], round(rng.lognormvariate(mu, sigma)))))


def synthesize_session(index: int, seed: int = 0, params: GenParams = GenParams()) -> dict[str, Any]:
    """Session `index` of the workload `seed`, as agent JSON (the same whatever the number of sessions)."""
    p = params
    rng = random.Random(f"agent-gen/{seed}/{index}")
    lo, hi = p.context
    length = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    ids: list[int] = []
    next_id = 1
    t = api = 0.0
    requests = []
    for i in range(rng.randint(*p.turns)):
        think = 0.0
        if i:
            pause = rng.random() < p.think_pause_p
            think = rng.lognormvariate(p.pause_mu, p.pause_sigma) if pause else rng.lognormvariate(
                p.think_mu, p.think_sigma)
            t += api + think
            length += _lognormal(rng, p.append_mu, p.append_sigma, p.append_clip)
            if rng.random() < p.rewrite_p:
                ids = ids[: int(rng.random() * len(ids))]
            elif ids and rng.random() < p.tail_rewrite_p:
                ids = ids[:-1]
        new = length // p.block_size - len(ids)
        ids += range(next_id, next_id + new)
        next_id += new
        out = _lognormal(rng, p.out_mu, p.out_sigma, p.out_clip)
        api = p.api_base_s + out / p.api_tokens_per_s
        requests.append({"t": round(t, 1), "type": "n", "in": length, "out": out, "hash_ids": list(ids),
                         "think_time": round(think, 1), "api_time": round(api, 2)})
    return {"id": f"synthetic_{seed}_{index:04d}", "block_size": p.block_size, "hash_id_scope": "local",
            "generator": {"seed": seed, "index": index, "params": asdict(p)}, "requests": requests}


def synthesize(n: int, seed: int = 0, params: GenParams = GenParams()) -> list[dict[str, Any]]:
    return [synthesize_session(i, seed, params) for i in range(n)]


def write_sessions(sessions: Iterable[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One file per session, named by its id."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in sessions:
        path = directory / f"{s['id']}.json"
        path.write_text(json.dumps(s, separators=(",", ":")) + "\n")
        paths.append(path)
    return paths


# ---------------------------------------------------------------------- statistics of sessions


def _quantiles(xs: Sequence[float]) -> dict[str, float]:
    from hicache.bench_client.report import percentile

    if not xs:
        return {}
    return {"n": len(xs), "min": min(xs), "p10": percentile(xs, 10), "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "max": max(xs), "mean": statistics.fmean(xs)}


def _lognormal_fit(xs: Sequence[float]) -> dict[str, float]:
    logs = [math.log(x) for x in xs if x > 0]
    if len(logs) < 2:
        return {}
    return {"mu": statistics.fmean(logs), "sigma": statistics.stdev(logs)}


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def describe(sessions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The statistics `synthesize` draws from, measured on agent JSON sessions (sub-agents counted, not walked)."""
    initial, final, turns, appends, thinks, outs, api = [], [], [], [], [], [], []
    tail_rewrites, rewrites, transitions, subagents = 0, [], 0, 0
    for s in sessions:
        reqs = [r for r in s["requests"] if r.get("type") != "subagent"]
        subagents += len(s["requests"]) - len(reqs)
        if not reqs:
            continue
        turns.append(len(reqs))
        initial.append(reqs[0]["in"])
        final.append(reqs[-1]["in"])
        for r in reqs:
            outs.append(r["out"])
            if isinstance(r.get("api_time"), (int, float)):
                api.append((r["out"], r["api_time"]))
        for a, b in zip(reqs, reqs[1:]):
            transitions += 1
            kept = _common_prefix(a["hash_ids"], b["hash_ids"])
            if kept < len(a["hash_ids"]) - 1:
                rewrites.append(kept / len(a["hash_ids"]))
                continue
            tail_rewrites += kept == len(a["hash_ids"]) - 1
            appends.append(b["in"] - a["in"])
            if isinstance(b.get("think_time"), (int, float)):
                thinks.append(b["think_time"])
    short, pauses = [x for x in thinks if 0 < x <= PAUSE_S], [x for x in thinks if x > PAUSE_S]
    fit_api = {}
    if len(api) > 1 and len({o for o, _ in api}) > 1:
        slope, base = statistics.linear_regression([o for o, _ in api], [a for _, a in api])
        fit_api = {"n": len(api), "base_s": base, "tokens_per_s": 1.0 / slope if slope > 0 else math.inf}
    return {
        "sessions": len(turns), "requests": sum(turns), "transitions": transitions, "subagents": subagents,
        "turns": _quantiles(turns), "initial_context": _quantiles(initial), "final_context": _quantiles(final),
        "appended": {**_quantiles(appends), "lognormal": _lognormal_fit(appends)},
        "tail_rewrites": {"n": tail_rewrites, "p": tail_rewrites / len(appends) if appends else math.nan},
        "rewrites": {"n": len(rewrites), "p": len(rewrites) / transitions if transitions else math.nan,
                     "kept": rewrites},
        "think_s": {**_quantiles(thinks), "pause_above_s": PAUSE_S,
                    "pause_p": len(pauses) / len(thinks) if thinks else math.nan,
                    "short": _lognormal_fit(short), "pause": _lognormal_fit(pauses)},
        "output": {**_quantiles(outs), "lognormal": _lognormal_fit(outs)},
        "api_time": fit_api,
    }


def read_agent_json(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The raw agent JSON objects of files and directories (for `describe`)."""
    out = []
    for path in (f for p in paths for f in _files(Path(p))):
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TraceError(f"{path}: not an agent session JSON file: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("requests"), list):
            raise TraceError(f"{path}: not an agent session JSON file (no `requests` list)")
        out.append(obj)
    return out
