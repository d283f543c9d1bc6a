"""The coding-agent session format (../shared/traces/agent/), parsed once for both of its readers: the replay
(`read_agent_sessions`: requests flattened into a trace at their recorded times) and the
benchmark client (hicache/bench_client/workload.py: closed-loop sessions with their think times).

A file is one session: `block_size` tokens per hash id (64), `requests` in time order, each with `in` (input
tokens, >= 1), `out`, `hash_ids` (one id per FULL block of the input: integers or strings), and optionally `t`
(seconds from the session's start), `think_time` and `api_time`; an entry of `type` "subagent" holds its own
`requests` (and maybe an `agent_id`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.replay.trace import Trace, TraceError, TraceRecord, block_token


@dataclass
class AgentTurn:
    """One request of a session, as recorded."""

    index: int  # position among its session's entries
    input_length: int
    output_length: int
    hash_ids: list[Any]
    t: float  # seconds from the session's start
    think_time: float | None  # seconds the agent spent before sending it; None where not recorded
    api_time: float | None  # the recorded server time of the request, where there is one
    think_s: float = 0.0  # the wait before it, closed loop: think_time, else the gap since the previous turn less
    # that turn's api_time (0 for a session's first turn)


@dataclass
class AgentSession:
    """A session's entries in order: turns, and sub-agents (consecutive ones form one group)."""

    agent_id: str | None = None
    steps: list[AgentTurn | list[AgentSession]] = field(default_factory=list)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse_agent_session(obj: dict[str, Any], block_size: int, where: str) -> AgentSession:
    """A session object (or a sub-agent entry) checked and parsed; TraceError names the entry that is wrong."""
    session = AgentSession(str(obj["agent_id"]) if obj.get("agent_id") else None)
    requests = obj.get("requests")
    if not isinstance(requests, list):
        raise TraceError(f"{where}: `requests` must be a list")
    group: list[AgentSession] | None = None
    prev: AgentTurn | None = None
    for i, r in enumerate(requests):
        if not isinstance(r, dict):
            raise TraceError(f"{where}: request {i} is not an object")
        if r.get("type") == "subagent":
            sub = parse_agent_session(r, block_size, f"{where} sub-agent {i}")
            if group is None:
                group = []
                session.steps.append(group)
            group.append(sub)
            continue
        group = None
        ids, n_in, n_out, t = r.get("hash_ids"), r.get("in"), r.get("out"), r.get("t", 0.0)
        if (not isinstance(ids, list) or isinstance(n_in, bool) or not isinstance(n_in, int) or n_in < 1
                or _number(t) is None):
            raise TraceError(f"{where}: request {i} needs `in` >= 1, a numeric `t` and a `hash_ids` list")
        if not all(isinstance(h, (int, str)) and not isinstance(h, bool) for h in ids):
            raise TraceError(f"{where}: request {i}: every hash id must be an integer or a string")
        if len(ids) > -(-n_in // block_size):
            raise TraceError(f"{where}: request {i} has {len(ids)} hash_ids for {n_in} tokens")
        out = n_out if isinstance(n_out, int) and not isinstance(n_out, bool) else 0
        turn = AgentTurn(i, n_in, max(0, out), ids, float(t), _number(r.get("think_time")), _number(r.get("api_time")))
        think = turn.think_time
        if think is None:
            think = 0.0 if prev is None else turn.t - prev.t - (prev.api_time or 0.0)
        turn.think_s = max(0.0, think)
        session.steps.append(turn)
        prev = turn
    return session


AGENT = "agent"  # coding-agent session JSON (../shared/traces/agent/): one session per file


def _agent_requests(session: AgentSession, scope: str, start_s: float, out: list[TraceRecord], tokens: dict) -> None:
    """A parsed session's requests (sub-agents flattened in, same id scope) as records at start_s + their own `t`.
    `tokens`: the session's ids already mapped (each turn repeats the prefix of the one before)."""
    for step in session.steps:
        if isinstance(step, list):
            for sub in step:
                _agent_requests(sub, scope, start_s, out, tokens)
            continue
        out.append(TraceRecord((start_s + step.t) * 1e3, step.input_length, step.output_length,
                               [tokens.get(h) or tokens.setdefault(h, block_token(f"{scope}:{h}"))
                                for h in step.hash_ids], step.index + 1))


def load_agent_sessions(paths: Sequence[str | Path]) -> tuple[int, list[tuple[str, AgentSession]]]:
    """Agent-session JSON files (or directories of them), parsed: (block size, [(hash id scope, session)]) in file
    order; hash ids are unique per session (scope: the file's `id`, or its name) unless the file says
    `hash_id_scope: global`."""
    files = []
    for p in map(Path, paths):
        files += sorted(f for f in p.iterdir() if f.suffix == ".json") if p.is_dir() else [p]
    if not files:
        raise TraceError(f"{', '.join(map(str, paths))}: no agent session files (.json)")
    sessions: list[tuple[str, AgentSession]] = []
    block_tokens = None
    for k, f in enumerate(files):
        try:
            obj = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise TraceError(f"{f}: not an agent session file: {e}") from None
        if not isinstance(obj, dict) or "requests" not in obj:
            raise TraceError(f"{f}: not an agent session file (no `requests`)")
        bt = obj.get("block_size", 64)
        if not isinstance(bt, int) or isinstance(bt, bool) or bt < 1:
            raise TraceError(f"{f}: block_size must be a positive integer")
        if block_tokens is None:
            block_tokens = bt
        elif bt != block_tokens:
            raise TraceError(f"{f}: block_size {bt} differs from the other files' {block_tokens}")
        scope = "global" if obj.get("hash_id_scope") == "global" else f"{k}:{obj.get('id') or f.stem}"
        sessions.append((scope, parse_agent_session(obj, bt, str(f))))
    assert block_tokens is not None
    return block_tokens, sessions


def read_agent_sessions(paths: Sequence[str | Path], offset_s: float = 0.0) -> Trace:
    """Agent-session JSON files (or directories of them) as one trace: session k starts at k * offset_s seconds
    (0: all at once), its requests at their own `t` after that, all of them in time order; hash ids are unique per
    session (scope: the file's `id`, or its name) unless the file says `hash_id_scope: global`. Sub-agents are
    flattened into their session at their own times."""
    block_tokens, sessions = load_agent_sessions(paths)
    records: list[TraceRecord] = []
    for k, (scope, session) in enumerate(sessions):
        _agent_requests(session, scope, k * offset_s, records, {})
    records.sort(key=lambda r: r.timestamp_ms)
    for line, rec in enumerate(records, 1):
        rec.line = line
    name = str(paths[0]) if len(paths) == 1 else f"{len(sessions)} agent sessions"
    return Trace(name, AGENT, block_tokens, records)


def is_agent_trace(path: str | Path) -> bool:
    """A directory, or a .json file holding one JSON object with `requests` (not JSON lines)."""
    p = Path(path)
    if p.is_dir():
        return True
    if p.suffix != ".json" or not p.is_file():
        return False
    with open(p, "rb") as f:
        head = f.read(1 << 16).lstrip()
    return head.startswith(b"{") and b'"requests"' in head
