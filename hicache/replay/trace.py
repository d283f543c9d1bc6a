"""Request traces for replay: Mooncake JSONL and the server's own trace log, read and written.

Both formats are JSON lines with `timestamp` (ms), `input_length`, `output_length` and `hash_ids`
(prefix-chained ids of `block_tokens`-token blocks: equal id = equal block and equal prefix).
A line is a trace-log line when it carries `block_tokens`; the first valid line fixes the format.

Trace-log line (version 1), written by the server through `trace_record` / `trace_line`:

    {"v": 1, "timestamp": 1718000000123.5, "input_length": 1000, "output_length": 64,
     "block_tokens": 16, "hash_ids": [...62 ids...],
     "cached_tokens": {"device": 512, "host": 256, "disk": 0}, "ttft_ms": 41.2}

hash_ids there holds one id per FULL page of the prompt (input_length // block_tokens ids): the
first 63 bits of the page's chained L3 key (`page_hash_id`). Mooncake files list
ceil(input_length / block_tokens) ids (the last block usually partial); both lengths are accepted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radix import TIERS

TRACE_LOG_VERSION = 1
MOONCAKE, TRACE_LOG = "mooncake", "trace-log"



class TraceError(ValueError):
    """An unreadable trace (or, with strict, a bad line); the message names file and line."""


@dataclass(slots=True)
class TraceRecord:
    """One request of a trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[Any]
    line: int  # 1-based line number in the file
    cached_tokens: dict[str, int] | None = None  # trace-log only: what the server reported per tier
    ttft_ms: float | None = None  # trace-log only


@dataclass
class Trace:
    """The valid records of a file, its format and block size, and the lines that were skipped."""

    path: str
    format: str
    block_tokens: int
    records: list[TraceRecord] = field(default_factory=list)
    bad_lines: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)

    @property
    def blocks(self) -> int:
        return sum(len(r.hash_ids) for r in self.records)


# ---------------------------------------------------------------------- writing (the server's side)


def page_hash_id(key: bytes) -> int:
    """The trace-log id of a page: the first 63 bits of its chained L3 key (fits a signed int64)."""
    return int.from_bytes(key[:8], "little") >> 1


def trace_record(
    timestamp_ms: float,
    input_length: int,
    output_length: int,
    page_keys: Sequence[bytes] | Sequence[int],
    block_tokens: int,
    cached_tokens: Mapping[str, int],
    ttft_ms: float | None,
) -> dict[str, Any]:
    """One trace-log record (a JSON-ready dict) for a finished request.

    page_keys: the chained keys of the prompt's full pages (radix `page_keys`, bytes) or their ids.
    cached_tokens: prompt tokens served from each tier ("device", "host", "disk", and "remote", which is
    logged as disk), as the controller's ticket reported them (hit pages * page size).
    """
    if len(page_keys) != input_length // block_tokens:
        raise ValueError(f"trace_record: {len(page_keys)} page ids for {input_length} tokens "
                         f"at {block_tokens} tokens per page (want {input_length // block_tokens})")
    ids = [page_hash_id(k) if isinstance(k, bytes) else int(k) for k in page_keys]
    return {
        "v": TRACE_LOG_VERSION,
        "timestamp": timestamp_ms,
        "input_length": input_length,
        "output_length": output_length,
        "block_tokens": block_tokens,
        "hash_ids": ids,
        # the replay has one disk tier: the remote tier's hits (controller.stats.REMOTE) count as disk hits
        "cached_tokens": {t: int(cached_tokens.get(t, 0)) + (int(cached_tokens.get("remote", 0)) if t == "disk" else 0)
                          for t in TIERS},
        "ttft_ms": ttft_ms,
    }


def trace_line(*args: Any, **kwargs: Any) -> str:
    """`trace_record(...)` as one JSON line (with the trailing newline)."""
    return json.dumps(trace_record(*args, **kwargs), separators=(",", ":")) + "\n"


# ---------------------------------------------------------------------- reading


def _int(obj: dict, name: str, minimum: int = 0) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


MAX_LINE_BYTES = 16 << 20  # a longer line is bad input: refused without reading it into memory whole
TOKEN_ID_LIMIT = 1 << 62  # hash ids in [0, 2^62) are the blocks' tokens as they are


def block_token(value: int | str) -> int:
    """The radix-tree token of a block's hash id: small non-negative integers as they are; strings and integers
    outside [0, 2^62) (negative, or up to any size) a 62-bit hash of their text, with bit 62 set, so that they never
    equal a small id and still fit the tree's int64 page keys. Equal ids give equal tokens."""
    if isinstance(value, int) and 0 <= value < TOKEN_ID_LIMIT:
        return value
    digest = hashlib.blake2b(f"{type(value).__name__}:{value}".encode(), digest_size=8).digest()
    return TOKEN_ID_LIMIT | (int.from_bytes(digest, "little") & (TOKEN_ID_LIMIT - 1))


def _parse(obj: Any, fmt: str, block_tokens: int) -> TraceRecord:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError(f"timestamp must be a number (ms), got {ts!r}")
    input_length = _int(obj, "input_length")
    output_length = _int(obj, "output_length")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in ids):
        raise ValueError("hash_ids must be a list of integers (or strings)")
    full, ceil = input_length // block_tokens, -(-input_length // block_tokens)
    if len(ids) not in (full, ceil):
        raise ValueError(f"{len(ids)} hash_ids for input_length {input_length} at {block_tokens} tokens per "
                         f"block (want {full}" + (f" or {ceil})" if ceil != full else ")"))
    rec = TraceRecord(float(ts), input_length, output_length, [block_token(i) for i in ids], 0)
    if fmt == TRACE_LOG:
        bt = _int(obj, "block_tokens", 1)
        if bt != block_tokens:
            raise ValueError(f"block_tokens {bt} differs from the trace's {block_tokens}")
        cached = obj.get("cached_tokens") or {}
        if not isinstance(cached, dict) or set(cached) - set(TIERS):
            raise ValueError(f"cached_tokens must map {list(TIERS)} to token counts, got {cached!r}")
        rec.cached_tokens = {t: _int(cached, t) if t in cached else 0 for t in TIERS}
        ttft = obj.get("ttft_ms")
        rec.ttft_ms = float(ttft) if isinstance(ttft, (int, float)) and not isinstance(ttft, bool) else None
    return rec


def parse_lines(lines: Iterable[str], path: str = "<trace>", block_tokens: int | None = None,
                strict: bool = False) -> Trace:
    """Parse trace lines; the format is detected from the first valid line.

    block_tokens: the block size of a Mooncake trace (default 512); a trace log carries its own,
    and an explicit value that disagrees with it is an error. Bad lines are skipped and listed in
    `bad_lines`, or raise TraceError with `strict`. Blank lines are ignored.
    """
    trace: Trace | None = None
    pending_bad: list[tuple[int, str]] = []
    for lineno, text in enumerate(lines, 1):
        if isinstance(text, _LineTooLong):
            reason = f"line longer than {MAX_LINE_BYTES} bytes"
            if strict:
                raise TraceError(f"{path}:{lineno}: {reason}")
            pending_bad.append((lineno, reason))
            continue
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
            if trace is None:
                fmt = TRACE_LOG if isinstance(obj, dict) and "block_tokens" in obj else MOONCAKE
                bt = block_tokens or 512
                if fmt == TRACE_LOG:
                    if obj.get("v", TRACE_LOG_VERSION) != TRACE_LOG_VERSION:
                        raise TraceError(f"{path}:{lineno}: trace log version {obj['v']!r}; this hicache reads "
                                         f"version {TRACE_LOG_VERSION}")
                    bt = _int(obj, "block_tokens", 1)
                    if block_tokens is not None and block_tokens != bt:
                        raise TraceError(f"{path}:{lineno}: trace log has block_tokens {bt} but "
                                         f"--block-tokens {block_tokens} was given")
                candidate = Trace(path, fmt, bt)
                rec = _parse(obj, fmt, bt)
                trace = candidate
            else:
                if trace.format == TRACE_LOG and isinstance(obj, dict) and obj.get("v", TRACE_LOG_VERSION) != \
                        TRACE_LOG_VERSION:
                    raise ValueError(f"trace log version {obj['v']!r}, not {TRACE_LOG_VERSION}")
                rec = _parse(obj, trace.format, trace.block_tokens)
        except (ValueError, TypeError) as e:
            if isinstance(e, TraceError):
                raise
            reason = f"invalid JSON: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
            if strict:
                raise TraceError(f"{path}:{lineno}: {reason}") from None
            pending_bad.append((lineno, reason))
            continue
        rec.line = lineno
        trace.records.append(rec)
    if trace is None:
        raise TraceError(f"{path}: no valid request lines" + (
            f" ({len(pending_bad)} bad; first at line {pending_bad[0][0]}: {pending_bad[0][1]})" if pending_bad else ""
        ))
    trace.bad_lines = pending_bad
    return trace


class _LineTooLong(str):
    """A line past MAX_LINE_BYTES, read no further than that: the parser reports it as a bad line."""


def _bounded_lines(f: Any) -> Iterator[str]:
    """The file's lines, none held longer than MAX_LINE_BYTES: a longer one is skipped in pieces and given as a
    marker, so a file with no newline does not end up whole in memory."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith("\n"):
            while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith("\n"):
                pass
            yield _LineTooLong("")
            continue
        yield line


def read_trace(path: str | Path, block_tokens: int | None = None, strict: bool = False) -> Trace:
    """Read a Mooncake or trace-log JSONL file (see `parse_lines`); TraceError if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_lines(_bounded_lines(f), str(path), block_tokens, strict)
    except OSError as e:
        raise TraceError(f"{path}: cannot read trace: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not a UTF-8 text file ({e.reason})") from None
